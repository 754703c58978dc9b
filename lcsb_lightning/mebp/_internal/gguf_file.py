"""A lean GGUF reader: tensor names, types, shapes and memory-mapped data (shaped as ``gguf.GGUFReader`` shapes
them), and scalar metadata. Metadata arrays are skipped, not built: ``gguf.GGUFReader`` spends about 6 s and
160 MB on the objects of SmolLM2's tokenizer arrays, which loading weights never reads.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
#: struct format of each scalar GGUF value type (little endian).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
#: numpy dtype of the tensor types ``gguf.GGUFReader`` exposes as elements rather than bytes.
_ELEMENT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class ArrayField:
    """A metadata array, not read: its element type (a GGUF value type) and length."""

    element_type: int
    length: int


@dataclass(frozen=True)
class Field:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray


class _Cursor:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.at = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        text = bytes(self.buffer[self.at : self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type, length = self.scalar("<I"), self.scalar("<Q")
            if element_type == _STRING:
                for _ in range(length):
                    self.at += 8 + int(np.frombuffer(self.buffer, np.uint64, 1, self.at)[0])
            elif element_type in _SCALARS:
                self.at += struct.calcsize(_SCALARS[element_type]) * length
            else:
                raise ValueError(f"GGUF: arrays of value type {element_type} are not supported")
            return ArrayField(element_type, length)
        if value_type not in _SCALARS:
            raise ValueError(f"GGUF: unknown value type {value_type}")
        return self.scalar(_SCALARS[value_type])


class GGUFFile:
    """Open ``path`` (a GGUF file, version 2 or 3, little endian) and parse its header, metadata and tensor table.

    Raises:
        ValueError: not a GGUF file, a big-endian or unsupported version.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = os.fspath(path)
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._map: np.memmap | None = mapped
        cursor = _Cursor(mapped)
        if bytes(mapped[:4]) != _MAGIC:
            raise ValueError(f"{self.path!r} is not a GGUF file (no GGUF magic)")
        cursor.at = 4
        self.version = version = cursor.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path!r}: GGUF version {version} is not supported (2 and 3 little-endian are)")
        tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata_start = cursor.at
        self.fields: dict[str, Any] = {cursor.string(): cursor.value(cursor.scalar("<I")) for _ in range(kv_count)}
        #: Byte range of the metadata key-value pairs, as stored (a merged file copies it unchanged).
        self.metadata_span = (metadata_start, cursor.at)
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
            infos.append((name, dims, GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
        self.alignment = alignment = int(self.fields.get("general.alignment", 32))
        start = -(-cursor.at // alignment) * alignment
        self.tensors: list[Tensor] = []
        for name, dims, qtype, offset in infos:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = (int(np.prod(dims)) if dims else 1) * type_size // block_size
            raw, shape = mapped[start + offset : start + offset + nbytes], tuple(reversed(dims))
            data = (raw.view(_ELEMENT_TYPES[qtype.name]).reshape(shape) if qtype.name in _ELEMENT_TYPES
                    else raw.reshape(quant_shape_to_byte_shape(shape, qtype)))
            self.tensors.append(Tensor(name, qtype, dims, data))

    def close(self) -> None:
        """Drop the memory map and the tensors' views of it: the file is unmapped once no other view is alive."""
        self.tensors, self._map = [], None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_field(self, key: str) -> Field | None:
        """The metadata value ``key`` (arrays as :class:`ArrayField`), as ``gguf.GGUFReader.get_field`` names it."""
        return Field(self.fields[key]) if key in self.fields else None
