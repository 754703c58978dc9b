"""MeBP: compressed frozen weights decompressed on the fly, per-block checkpointing, mmap offload.

The public API is what this module exports (the internals live in ``_internal``); importing it needs neither
bitsandbytes nor CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from lcsb_lightning.mebp._internal import bnb_notice  # noqa: F401  (filters a bitsandbytes notice)
from lcsb_lightning.mebp._internal.formats import FORMATS
from lcsb_lightning.mebp._internal.stats import MeBPStats
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear
from lcsb_lightning.mebp.config import MeBPConfig
from lcsb_lightning.mebp.convert import MeBPState, apply_mebp, mebp_state
from lcsb_lightning.mebp.loss import chunked_lm_loss, logit_transform

# The plugin imports Lightning and the loader imports transformers/gguf: load them on first use.
_LAZY = {"QuantizedMeBP": "lcsb_lightning.mebp.plugin", "load_compressed": "lcsb_lightning.mebp.loading",
         "load_float": "lcsb_lightning.mebp.loading"}

__all__ = ["QuantizedMeBP", "MeBPConfig", "apply_mebp", "load_compressed", "load_float", "chunked_lm_loss",
           "logit_transform", "mebp_state", "MeBPState", "MeBPStats", "CompressedLinear", "CompressedEmbedding",
           "FORMATS"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lcsb_lightning.mebp' has no attribute {name!r}")
