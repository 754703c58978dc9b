"""The base of the stored weight formats: codes, a scale per group of a row and, if asymmetric, a minimum,
``w = value(code) * scale (+ minimum)``, the product rounded first as gguf's numpy code rounds it, so that GGUF
blocks kept as they are dequantize bit for bit. Rows dequantize alone (embedding lookups, output chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

#: Rows are quantized in slices of at most this many weights (bounds the temporaries).
QUANTIZE_CHUNK_ELEMENTS = 1 << 18
#: Integer dtype as wide as two values of a float dtype: a byte's two codes are then looked up as one.
_PAIR_AS_INT = {4: torch.int64, 2: torch.int32}
#: Every stored format by name: a subclass of :class:`StoredFormat` with a ``name`` registers its instance.
REGISTRY: dict[str, StoredFormat] = {}


@dataclass(frozen=True)
class Packed:
    """A compressed weight: ``codes`` uint8 ``(out, in // codes_per_byte)``, ``scales`` ``(out, in // group_size)``
    and, for the asymmetric formats, ``mins`` of the same shape as ``scales``."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scales) if self.mins is None else (self.codes, self.scales, self.mins)


def select_rows(packed: Packed, index: torch.Tensor | slice) -> Packed:
    """The compressed rows ``index`` of ``packed`` (an embedding lookup or an output chunk)."""
    return Packed(*(tensor[index] for tensor in packed.tensors()))


class StoredFormat:
    """Integer codes, a scale per group and, if ``asymmetric``, a minimum; a subclass with a ``name`` registers
    its singleton.

    Attributes:
        name: What ``CompressedLinear.fmt`` and the logs call it.
        code_bits: Bits of one code's value: up to 4 packed two a byte (the first in the high nibble), else one.
        signed: Values centred on zero: a packed code is ``value + 8``, a byte code the value as int8.
        asymmetric: A minimum per group, added after the product (unsigned values then).
        scale_dtype: dtype of the scales and minimums.
        gguf_type: The GGUF block type whose blocks it holds as they are (``gguf_blocks``), if any.
    """

    name: ClassVar[str]
    code_bits: ClassVar[int] = 4
    signed: ClassVar[bool] = True
    asymmetric: ClassVar[bool] = False
    scale_dtype: ClassVar[torch.dtype] = torch.float32
    gguf_type: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            REGISTRY[cls.name] = cls()

    def __repr__(self) -> str:
        return self.name

    @property
    def codes_per_byte(self) -> int:
        return 2 if self.code_bits <= 4 else 1

    def bits_per_weight(self, group_size: int) -> float:
        """Stored bits of one weight: its code plus its share of the group's scale (and minimum)."""
        return 8 / self.codes_per_byte + torch.finfo(self.scale_dtype).bits * (1 + self.asymmetric) / group_size

    def columns(self, packed: Packed) -> int:
        """Input features of the weight ``packed`` holds."""
        return packed.codes.shape[1] * self.codes_per_byte

    def validate(self, group_size: int) -> None:
        """Fail on a ``group_size`` this format cannot use (any even one here)."""

    def error_bound(self) -> float:
        """Largest round-trip error of one weight, as a fraction of its group's largest magnitude: half a step
        (asymmetric steps are ``(max - min) / levels <= 2 absmax / levels``), plus ``2^-9`` for fp16 scales."""
        half_step = 1 / (2**self.code_bits - 1) if self.asymmetric else 0.5 / (2 ** (self.code_bits - 1) - 1)
        return half_step + (2.0**-9 if self.scale_dtype == torch.float16 else 0.0)

    def allocate(self, shapes: list[tuple[int, int]], group_size: int, device: torch.device | str = "cpu") -> list[Packed]:
        """Empty :class:`Packed` tensors for weights of ``shapes``, all views of one byte buffer: an allocation
        this large is served outside the heap, which then does not grow around hundreds of compressed tensors."""
        per_byte, itemsize, align = self.codes_per_byte, self.scale_dtype.itemsize, 8  # 8: viewable as any dtype
        for _, cols in shapes:
            if cols % group_size or cols % per_byte:
                raise ValueError(f"`group_size={group_size}` does not divide a weight's {cols} columns.")
        sizes = [[rows * cols // per_byte] + [rows * cols // group_size * itemsize] * (1 + self.asymmetric)
                 for rows, cols in shapes]
        buffer = torch.empty(sum(-(-size // align) * align for weight in sizes for size in weight), dtype=torch.uint8,
                             device=device)
        out, at = [], 0
        for (rows, cols), weight_sizes in zip(shapes, sizes):
            views = []
            for i, nbytes in enumerate(weight_sizes):
                view, at = buffer[at : at + nbytes], at + -(-nbytes // align) * align
                views.append(view.view(rows, cols // per_byte) if i == 0 else view.view(self.scale_dtype).view(rows, -1))
            out.append(Packed(*views))
        return out

    def quantize(self, weight: torch.Tensor, group_size: int, out: Packed | None = None) -> Packed:
        """Compress a 2-D weight ``(out, in)`` (into ``out``, a slot from :meth:`allocate`, if given), in slices
        of :data:`QUANTIZE_CHUNK_ELEMENTS` weights."""
        if weight.dim() != 2:
            raise ValueError(f"Expected a 2-D weight, got shape {tuple(weight.shape)}.")
        rows, cols = weight.shape
        if cols % group_size:
            raise ValueError(f"`group_size={group_size}` does not divide the weight's {cols} columns.")
        if out is None:
            (out,) = self.allocate([(rows, cols)], group_size, weight.device)
        step = max(1, QUANTIZE_CHUNK_ELEMENTS // cols)
        for start in range(0, rows, step):
            self.quantize_into(weight[start : start + step], group_size, select_rows(out, slice(start, start + step)))
        return out

    def quantize_into(self, weight: torch.Tensor, group_size: int, out: Packed) -> None:
        """Quantize ``weight`` ``(rows, in)`` into the slot ``out`` of the same rows: each group rounded to
        its nearest code, against the scale (and minimum) as stored (fp16 ones rounded first)."""
        rows, cols = weight.shape
        groups = weight.detach().float().reshape(rows, cols // group_size, group_size)
        if self.asymmetric:
            assert out.mins is not None
            low, high = 0, 2**self.code_bits - 1
            out.mins.copy_(groups.amin(dim=-1))
            out.scales.copy_((groups.amax(dim=-1) - out.mins.float()) / high)
            groups = groups - out.mins.float().unsqueeze(-1)
        else:
            high = 2 ** (self.code_bits - 1) - 1
            low = -high - 1
            out.scales.copy_(groups.abs().amax(dim=-1) / high)
        scale = out.scales.float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        self.store_codes(torch.round(groups / safe).clamp_(low, high).reshape(rows, cols), out)

    def store_codes(self, values: torch.Tensor, out: Packed) -> None:
        """Write code values ``(rows, in)`` (integers of this format's range) into ``out.codes``."""
        if self.codes_per_byte == 1:
            out.codes.copy_(values.to(torch.int8).view(torch.uint8) if self.signed else values.to(torch.uint8))
            return
        codes = (values + 8 if self.signed else values).to(torch.uint8)
        out.codes.copy_((codes[:, 0::2] << 4) | codes[:, 1::2])

    def code_values(self) -> torch.Tensor:
        """The value of each 4-bit code (16 float32), before scaling."""
        return torch.arange(16, dtype=torch.float32) - (8 if self.signed else 0)

    def dequantize(self, packed: Packed, group_size: int, dtype: torch.dtype, out: torch.Tensor | None = None,
                   index_buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Decompress ``packed`` (any rows, :func:`select_rows`) to a ``(out, in)`` tensor of ``dtype``, into
        ``out`` if given; ``index_buffer``, an int32 ``(r, in // 2)`` scratch, looks packed codes up ``r`` rows at
        a time without allocating."""
        codes = packed.codes
        rows, cols = codes.shape[0], self.columns(packed)
        if out is not None and (tuple(out.shape) != (rows, cols) or out.dtype != dtype):
            raise ValueError(f"`out` must be a {(rows, cols)} tensor of {dtype}, got {tuple(out.shape)} {out.dtype}.")
        if out is None:
            out = torch.empty(rows, cols, dtype=dtype, device=codes.device)
        if self.codes_per_byte == 1:
            out.copy_(codes.view(torch.int8) if self.signed else codes)
        else:
            pairs = self._code_pairs(codes.device, dtype)
            as_int = _PAIR_AS_INT.get(out.element_size())
            step = index_buffer.shape[0] if index_buffer is not None else rows  # the scratch may cover fewer rows
            for start in range(0, rows, step):
                part_codes, part_out = codes[start : start + step], out[start : start + step]
                n = part_codes.shape[0]
                index = index_buffer[:n].copy_(part_codes) if index_buffer is not None else part_codes.to(torch.int32)
                if as_int is not None:
                    target = part_out.view(as_int).reshape(-1)
                    torch.index_select(pairs.view(as_int).reshape(-1), 0, index.reshape(-1), out=target)
                else:
                    torch.index_select(pairs, 0, index.reshape(-1), out=part_out.reshape(-1, 2))
        grouped = out.view(rows, cols // group_size, group_size)
        grouped.mul_(packed.scales.to(dtype).unsqueeze(-1))
        if packed.mins is not None:  # a separate add: the product is rounded first, as gguf's numpy code does
            grouped.add_(packed.mins.to(dtype).unsqueeze(-1))
        return out

    def _code_pairs(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``(256, 2)``: byte ``b`` -> the values of its codes ``b >> 4`` and ``b & 15``, built once per device and dtype."""
        cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = self.__dict__.setdefault("_pairs", {})
        key = (torch.device(device), dtype)
        if key not in cache:
            byte, values = torch.arange(256), self.code_values()
            cache[key] = torch.stack((values[byte >> 4], values[byte & 15]), dim=-1).to(device=device, dtype=dtype)
        return cache[key]
