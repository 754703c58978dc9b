"""Write a LoRA adapter as a GGUF adapter file, and a base GGUF file with the adapter merged in; each is
renamed into place once complete (:func:`~lcsb_lightning.atomic_files.atomic_file`)."""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from torch import nn

from lcsb_lightning.export.lora_pairs import GGUFLora, gguf_lora
from lcsb_lightning.mebp._internal.gguf_file import GGUFFile
from lcsb_lightning.atomic_files import atomic_file

#: Tensor types a merged tensor can be stored in.
MERGED_TYPES: tuple[str, ...] = ("F16", "Q8_0")


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def save_gguf_adapter(model: nn.Module, base_gguf: str | os.PathLike[str], path: str | os.PathLike[str],
                      adapter_name: str = "default") -> Path:
    """Write ``model``'s LoRA adapter as a GGUF adapter that llama.cpp applies to ``base_gguf``.

    ``llama-cli -m base.gguf --lora adapter.gguf`` (and the runtimes of docs/gguf.md) loads it. The LoRA weights are
    F32, named after ``base_gguf``'s tensors, with rsLoRA and per-module scales carried exactly.

    Args:
        model: A ``peft.PeftModel`` (e.g. your LightningModule's ``self.model``) whose base model was
            loaded from ``base_gguf`` (in float or compressed).
        base_gguf: The base model's GGUF file, any quantization of the same model.
        path: Where to write (``adapter.gguf``); replaced only by a complete file.
        adapter_name: The peft adapter to write.

    Raises:
        ValueError: llama.cpp could not apply this adapter as trained (the message lists every reason),
            before anything is written.

    Example::

        >>> from lcsb_lightning.export import save_gguf_adapter
        >>> save_gguf_adapter(module.model, "SmolLM2-135M-Instruct.Q4_1.gguf", "adapter.gguf")  # doctest: +SKIP
    """
    import gguf

    lora, path = gguf_lora(model, base_gguf, adapter_name), Path(path)
    writer = gguf.GGUFWriter(None, lora.architecture)  # general.type = adapter, adapter.type = lora, F32 pairs
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora.alpha)
    for pair in lora.pairs:
        writer.add_tensor(f"{pair.gguf_name}.lora_a", pair.a)
        writer.add_tensor(f"{pair.gguf_name}.lora_b", pair.b)
    with _quiet(logging.getLogger("gguf.gguf_writer")), atomic_file(path, "wb") as handle:  # it logs each write at INFO
        writer.write_header_to_file(Path(handle.name))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def _tensor_info(name: str, dims: tuple[int, ...], qtype: int, offset: int) -> bytes:
    encoded = name.encode("utf-8")
    return b"".join((struct.pack("<Q", len(encoded)), encoded, struct.pack("<I", len(dims)),
                     struct.pack(f"<{len(dims)}Q", *dims), struct.pack("<IQ", qtype, offset)))


def _merged_tensor(data: np.ndarray, qtype: object, pair: object, alpha: float, target: object) -> np.ndarray:
    """The file's tensor (rows in file order) plus ``alpha / r · B A``, stored as ``target`` (raw bytes)."""
    import gguf

    weight = gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)
    weight = weight.reshape(pair.b.shape[0], pair.a.shape[1])
    scale = np.float32(alpha / pair.a.shape[0])
    weight = weight + scale * (pair.b @ pair.a)
    if target == gguf.GGMLQuantizationType.F16:
        return weight.astype(np.float16).view(np.uint8)
    return gguf.quants.quantize(weight, target)


def save_merged_gguf(model: nn.Module, base_gguf: str | os.PathLike[str], path: str | os.PathLike[str],
                     tensor_type: str = "F16", adapter_name: str = "default") -> Path:
    """Write ``base_gguf`` with ``model``'s LoRA adapter merged in: one file for runtimes that take no adapter.

    Each adapted tensor is dequantized, merged (``W + alpha / r · B A``) and stored as ``tensor_type``, one at a time;
    every other tensor and metadata key is copied byte for byte (``general.file_type`` still names the base's type).

    Args:
        model: A ``peft.PeftModel`` over the base model of ``base_gguf``.
        base_gguf: The base model's GGUF file.
        path: Where to write (``merged.gguf``); replaced only by a complete file.
        tensor_type: ``"F16"`` or ``"Q8_0"``, the merged tensors' type.
        adapter_name: The peft adapter to merge.

    Raises:
        ValueError: an unknown ``tensor_type``, or an adapter llama.cpp could not apply as trained; before
            anything is written.

    Example::

        >>> from lcsb_lightning.export import save_merged_gguf
        >>> save_merged_gguf(module.model, "SmolLM2-135M-Instruct.Q4_1.gguf", "merged.gguf")  # doctest: +SKIP
    """
    import gguf

    from lcsb_lightning.mebp._internal.sources import open_gguf

    if tensor_type not in MERGED_TYPES:
        raise ValueError(f"`tensor_type={tensor_type!r}` is not supported; choose one of {', '.join(map(repr, MERGED_TYPES))}.")
    target = gguf.GGMLQuantizationType[tensor_type]
    with open_gguf(base_gguf) as base:
        return _write_merged(gguf_lora(model, base, adapter_name), base, Path(path), target)


def _write_merged(lora: GGUFLora, base: GGUFFile, path: Path, target: object) -> Path:
    """The merged file: ``base``'s metadata bytes, tensor table with the adapted tensors' new type, then data."""
    import gguf

    pairs = {pair.gguf_name: pair for pair in lora.pairs}
    block_size, type_size = gguf.GGML_QUANT_SIZES[target]
    entries = []  # (tensor, its new type, its size in bytes)
    for tensor in base.tensors:
        if tensor.name in pairs:
            entries.append((tensor, target, int(np.prod(tensor.shape)) * type_size // block_size))
        else:
            entries.append((tensor, tensor.tensor_type, tensor.data.nbytes))
    align = base.alignment
    infos, offset = [], 0
    for tensor, qtype, nbytes in entries:
        infos.append(_tensor_info(tensor.name, tuple(int(d) for d in tensor.shape), int(qtype), offset))
        offset += -(-nbytes // align) * align
    start, stop = base.metadata_span
    with atomic_file(path, "wb") as out:
        out.write(b"GGUF" + struct.pack("<IQQ", base.version, len(entries), len(base.fields)))
        out.write(memoryview(base._map[start:stop]))
        out.write(b"".join(infos))
        _pad(out, align)
        for tensor, qtype, nbytes in entries:
            if tensor.name in pairs:
                data = _merged_tensor(tensor.data, tensor.tensor_type, pairs[tensor.name], lora.alpha, target)
            else:
                data = tensor.data
            raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            if raw.nbytes != nbytes:
                raise AssertionError(f"{tensor.name}: {raw.nbytes} bytes, expected {nbytes}")
            out.write(memoryview(raw))
            _pad(out, align)
    return path


def _pad(handle: BinaryIO, align: int) -> None:
    handle.write(b"\0" * (-handle.tell() % align))
