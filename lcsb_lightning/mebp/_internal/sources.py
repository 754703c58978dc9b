"""Weight sources for :func:`load_compressed` (random init, a safetensors folder, a GGUF file): one tensor, or a
range of its rows, at a time by Hugging Face parameter name, as float32. A GGUF source reads from the memory map
and holds one chunk plus one ``gguf.quants.dequantize`` call on at most ``DEQUANTIZE_ELEMENTS`` weights.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from lcsb_lightning.mebp._internal.formats import gguf_format
from lcsb_lightning.mebp._internal.gguf_blocks import GGUFBlocks
from lcsb_lightning.mebp._internal.stored import Packed
from lcsb_lightning.mebp._internal.gguf_file import GGUFFile

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor, TensorNameMap

#: GGUF architectures (``general.architecture``) a :class:`GGUFSource` reads: those transformers'
#: GGUF loader supports among the llama, Qwen2 and Gemma families (it has no ``gemma``, Gemma 1).
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "gemma2", "gemma3")
#: Largest number of weights dequantized in one ``gguf.quants.dequantize`` call (256 KiB of float32).
DEQUANTIZE_ELEMENTS = 1 << 16
#: GGUF tensor types that hold floats: quantizing them is no second quantization.
FLOAT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "F64")


class WeightSource(Protocol):
    def rows(self, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of parameter ``name`` (the whole tensor for 1-D shapes) as float32."""


class RandomSource:
    """Deterministic random init: normal(0, ``std``) for matrices, ones for norm weights, zeros for biases."""

    def __init__(self, std: float = 0.02, seed: int = 0) -> None:
        self.std = std
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def rows(self, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        if len(shape) == 1:
            return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)
        if start == 0 or name not in self._generators:  # rows are requested in order
            self._generators[name] = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        out = torch.empty(stop - start, *shape[1:])
        return out.normal_(0.0, self.std, generator=self._generators[name])


class SafetensorsSource:
    """A Hugging Face checkpoint folder (``model.safetensors`` or a sharded index)."""

    def __init__(self, folder: str, aliases: dict[str, str] | None = None) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as handle:
                weight_map = json.load(handle)["weight_map"]
            self.files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        else:
            single = os.path.join(folder, "model.safetensors")
            if not os.path.isfile(single):
                raise FileNotFoundError(f"No `model.safetensors` or `model.safetensors.index.json` in {folder!r}.")
            with safe_open(single, "pt") as handle:
                self.files = dict.fromkeys(handle.keys(), single)  # safe_open has keys() but no __iter__
        self.aliases = aliases or {}

    def _resolve(self, name: str) -> str:
        if name in self.files:
            return name
        alias = self.aliases.get(name)
        if alias in self.files:
            return alias
        raise KeyError(f"Parameter `{name}` is not in the checkpoint ({len(self.files)} tensors).")

    def rows(self, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        key = self._resolve(name)
        with self._safe_open(self.files[key], "pt") as handle:
            sliced = handle.get_slice(key)
            tensor = sliced[:] if len(shape) == 1 else sliced[start:stop]
        return tensor.float()


def gguf_architecture(reader: GGUFReader) -> str:
    """The file's ``general.architecture``; a ValueError unless it is one of :data:`GGUF_ARCHITECTURES`."""
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported by `load_compressed`; "
                         f"supported architectures: {', '.join(GGUF_ARCHITECTURES)}.")
    return str(arch)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Memory-map a GGUF file (:class:`GGUFFile`: no metadata array is built) and check its architecture."""
    reader = GGUFFile(path)
    gguf_architecture(reader)
    return reader


@functools.cache
def _dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` implements ``qtype`` (tried on one zero block)."""
    import gguf

    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def gguf_quant_types() -> tuple[str, ...]:
    """Names of the GGML tensor types the installed ``gguf`` package dequantizes (F32, F16, BF16, Q*, IQ*...)."""
    import gguf

    return tuple(qtype.name for qtype in gguf.GGMLQuantizationType if _dequantizable(qtype))


def gguf_tensor_name(name_map: TensorNameMap, hf_name: str) -> str | None:
    """GGUF tensor name of HF parameter ``hf_name`` (None if there is none); as transformers' loader does, names
    relative to each submodule are tried too (``model.x`` -> ``x``)."""
    base, _, suffix = hf_name.rpartition(".")
    parts = base.split(".")
    for first in range(len(parts)):
        mapped = name_map.get_name(".".join(parts[first:]))
        if mapped is not None:
            return f"{mapped}.{suffix}"
    return None


def rotary_heads(reader: GGUFFile | GGUFReader) -> dict[str, int]:
    """``{".attn_q.": heads, ".attn_k.": kv heads}`` of a file whose Q/K rows llama.cpp's converter stored in
    :func:`rotary_order` (a llama file with both head counts: where transformers' loader undoes it), else ``{}``."""
    arch = gguf_architecture(reader)
    heads, kv_heads = (reader.get_field(f"{arch}.attention.{key}") for key in ("head_count", "head_count_kv"))
    if arch != "llama" or heads is None or kv_heads is None:
        return {}
    return {".attn_q.": int(heads.contents()), ".attn_k.": int(kv_heads.contents())}


def rotary_order(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (Hugging Face order in): each head's rotary halves interleaved."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class GGUFSource:
    """A GGUF file, read in row ranges straight from its memory map, with transformers' GGUF loader's names
    (gguf's ``get_tensor_name_map``) and transforms: :func:`rotary_order` undone, Gemma 2/3 norms stored plus one.

    Args:
        gguf_file: Path of the file, or a :class:`GGUFFile` (or ``gguf.GGUFReader``) already open on it.
        model: The model to load (meta parameters are fine); parameters tied together share one GGUF tensor.

    Raises:
        ValueError: unsupported architecture, a parameter with no tensor in the file or of another
            shape, or a tensor type ``gguf`` cannot dequantize; all before any tensor is read.
    """

    def __init__(self, gguf_file: str | os.PathLike[str] | GGUFFile | GGUFReader, model: nn.Module) -> None:
        import gguf

        self.reader = gguf_file if isinstance(gguf_file, (GGUFFile, gguf.GGUFReader)) else GGUFFile(gguf_file)
        arch = gguf_architecture(self.reader)
        arch_id = {value: key for key, value in gguf.MODEL_ARCH_NAMES.items()}[arch]
        name_map = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
        by_name = {tensor.name: tensor for tensor in self.reader.tensors}
        groups: dict[int, list[tuple[str, torch.Size]]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append((name, param.shape))
        self.tensors: dict[str, ReaderTensor] = {}
        missing: list[str] = []
        for group in groups.values():
            found = [by_name[g] for g in (gguf_tensor_name(name_map, n) for n, _ in group) if g in by_name]
            missing.extend(n for n, _ in group if not found)
            self.tensors.update((name, self._checked(found[0], name, shape)) for name, shape in group if found)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"The GGUF file has no tensor for the parameters {shown} (architecture {arch!r}).")
        rotary = rotary_heads(self.reader)
        self._heads = {name: n for name, t in self.tensors.items() for key, n in rotary.items() if key in t.name}
        gemma = arch in ("gemma2", "gemma3")
        self._shifted = {name for name, tensor in self.tensors.items() if gemma and "norm.weight" in tensor.name}

    @staticmethod
    def _checked(tensor: ReaderTensor, name: str, shape: torch.Size) -> ReaderTensor:
        if not _dequantizable(tensor.tensor_type):
            raise ValueError(f"GGUF tensor `{tensor.name}` (parameter `{name}`) has type {tensor.tensor_type.name}, "
                             "which the installed gguf package cannot dequantize; supported types: "
                             f"{', '.join(gguf_quant_types())}.")
        file_shape = tuple(reversed([int(d) for d in tensor.shape]))
        if file_shape != tuple(shape):
            raise ValueError(f"GGUF tensor `{tensor.name}` has shape {file_shape}; parameter `{name}` has {tuple(shape)}.")
        return tensor

    def _file_rows(self, name: str, rows: int, start: int, stop: int) -> np.ndarray | None:
        """File row of each HF row ``start:stop`` of a Q/K tensor in :func:`rotary_order` (``rows`` rows), else None."""
        n_head = self._heads.get(name)
        return None if n_head is None else np.argsort(rotary_order(np.arange(rows), n_head))[start:stop]

    def _tensor(self, name: str) -> ReaderTensor:
        if name not in self.tensors:
            raise KeyError(f"Parameter `{name}` has no tensor in the GGUF file.")
        return self.tensors[name]

    def tensor_type(self, name: str) -> str:
        """The GGUF type of parameter ``name``'s tensor (``"Q4_K"``, ``"F16"``, ...)."""
        return str(self._tensor(name).tensor_type.name)

    def native_format(self, name: str) -> GGUFBlocks | None:
        """The stored format that holds parameter ``name``'s GGUF blocks as they are (None: read as floats)."""
        return gguf_format(self.tensor_type(name))

    def packed_rows_into(self, name: str, shape: torch.Size, start: int, stop: int, out: Packed) -> None:
        """Rows ``start:stop`` of parameter ``name``, copied block by block into the slot ``out`` of its
        :meth:`native_format`."""
        tensor = self._tensor(name)
        index = self._file_rows(name, shape[0], start, stop)
        raw = tensor.data[start:stop] if index is None else tensor.data[index]
        gguf_format(tensor.tensor_type.name).read_gguf(raw, out)  # type: ignore[union-attr]

    def rows(self, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of parameter ``name`` (the whole tensor for 1-D shapes) as float32."""
        from gguf.quants import dequantize

        tensor = self._tensor(name)
        qtype, data = tensor.tensor_type, tensor.data
        if len(shape) == 1:  # a norm or a bias: small, dequantized whole
            index = self._file_rows(name, shape[0], 0, shape[0])
            values = dequantize(data, qtype).reshape(-1)
            out = np.array(values if index is None else values[index], dtype=np.float32)  # a copy, never the map
        else:
            index = self._file_rows(name, shape[0], start, stop)
            out = np.empty((stop - start, shape[1]), dtype=np.float32)
            step = max(1, DEQUANTIZE_ELEMENTS // shape[1])
            for low in range(0, stop - start, step):
                high = min(low + step, stop - start)
                # A slice of the memory map is read in place; a gather copies only these packed rows.
                packed = data[start + low : start + high] if index is None else data[index[low:high]]
                out[low:high] = dequantize(packed, qtype)
        if name in self._shifted:
            out -= 1  # llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w
        return torch.from_numpy(out)
