"""lcsb_lightning: Layer-Cyclic Selective Backpropagation and memory-efficient 4-bit backprop for Lightning.

``import lcsb_lightning`` needs neither CUDA nor bitsandbytes; 4-bit formats import them lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

from lcsb_lightning.blocks import find_blocks, map_trainable_params
from lcsb_lightning.selective import SelectiveBackprop, is_skipped

__version__ = "0.11.0"

# Heavier pieces load on first use so that the core import stays light.
_LAZY = {
    "LCSBCallback": "lcsb_lightning.callback",
    "LCSBController": "lcsb_lightning.controller",
    "DivergenceGuard": "lcsb_lightning.guard",
    "HeapTrim": "lcsb_lightning.heap_trim",
    "ProgressiveFreezing": "lcsb_lightning.freezing",
    "FrozenPrefix": "lcsb_lightning.prefix_cache",
    "SelectionPolicy": "lcsb_lightning.policies",
    "build_policy": "lcsb_lightning.policies",
    "QuantizedMeBP": "lcsb_lightning.mebp",
    "apply_mebp": "lcsb_lightning.mebp",
    "load_compressed": "lcsb_lightning.mebp",
    "MeBPConfig": "lcsb_lightning.mebp",
    "chunked_lm_loss": "lcsb_lightning.mebp",
    "load_smollm2": "lcsb_lightning.recipes.models",
    "recompute_lower_blocks": "lcsb_lightning.recompute",
}

__all__ = ["find_blocks", "map_trainable_params", "SelectiveBackprop", "is_skipped", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lcsb_lightning' has no attribute {name!r}")
