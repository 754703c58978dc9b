"""GGUF out: a trained LoRA adapter as a GGUF adapter file, and merged into the base GGUF, for llama.cpp."""

from lcsb_lightning.export.gguf_files import MERGED_TYPES, save_gguf_adapter, save_merged_gguf
from lcsb_lightning.export.lora_pairs import check_gguf_lora, gguf_lora

__all__ = ["MERGED_TYPES", "check_gguf_lora", "gguf_lora", "save_gguf_adapter", "save_merged_gguf"]
