"""MeBP: 4-bit frozen weights decompressed on the fly, per-block checkpointing, mmap offload.

``import lcsb_lightning.mebp`` needs neither bitsandbytes nor CUDA; ``fmt="nf4"``/``"fp4"`` import
bitsandbytes when used.
"""

from __future__ import annotations

import importlib
from typing import Any

from lcsb_lightning.mebp.convert import apply_mebp, mebp_state
from lcsb_lightning.mebp.formats import FORMATS
from lcsb_lightning.mebp.layer import CompressedEmbedding, CompressedLinear
from lcsb_lightning.mebp.loss import chunked_lm_loss, logit_transform
from lcsb_lightning.mebp.stats import MeBPStats
from lcsb_lightning.mebp.workspace import DecompressionWorkspace

# The plugin imports Lightning and the loader imports transformers/gguf: load them on first use.
_LAZY = {
    "QuantizedMeBP": "lcsb_lightning.mebp.plugin",
    "load_compressed": "lcsb_lightning.mebp.loading",
}

__all__ = [
    "QuantizedMeBP",
    "apply_mebp",
    "load_compressed",
    "chunked_lm_loss",
    "logit_transform",
    "mebp_state",
    "CompressedLinear",
    "CompressedEmbedding",
    "FORMATS",
    "MeBPStats",
    "DecompressionWorkspace",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lcsb_lightning.mebp' has no attribute {name!r}")
