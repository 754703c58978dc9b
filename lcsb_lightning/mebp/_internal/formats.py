"""Stored weight formats as objects: one class per kind of block, as gguf-py's ``quants.py`` has one per GGML type.

A stored format keeps a 2-D weight ``(out, in)`` as codes, one scale per group of ``group_size``
consecutive weights of a row and, if it is asymmetric, one minimum: ``w = value(code) * scale (+ minimum)``.
The products are float32 rounded as gguf's numpy code rounds them (the product, then the minimum), so
that GGUF blocks kept as they are dequantize bit for bit as ``gguf.quants.dequantize`` does. Codes are
a uint8 tensor ``(out, in // 2)`` (two codes of at most 4 bits a byte, the first in the high nibble) or
``(out, in)`` (one a byte); scales and minimums are ``(out, in // group_size)``, so that rows (embedding
lookups, output chunks) dequantize alone.

Quantized here from float weights (``fmt=``): :class:`Int4` (``int4``), ``int4_asym`` (also GGUF Q4_1's
blocks), :class:`NF4` and :class:`FP4` (bitsandbytes' code books). The GGUF block types kept as they
are live in :mod:`~lcsb_lightning.mebp._internal.gguf_blocks`. Adding a format is one subclass: its
``name`` registers it (:func:`get_format`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

#: What ``fmt=`` accepts. ``auto`` keeps a GGUF file's blocks where a stored format holds them as they
#: are, and quantizes float weights to :data:`AUTO_FLOAT_FORMAT` at group :data:`AUTO_GROUP_SIZE`.
FORMATS: tuple[str, ...] = ("auto", "int4", "int4_asym", "nf4", "fp4")
#: ``fmt="auto"`` on float weights: the lowest error measured at 5 bits a weight or fewer on SmolLM2-135M's
#: matrices (docs/mebp.md, "Formats"; tests/test_mebp_format_table.py).
AUTO_FLOAT_FORMAT, AUTO_GROUP_SIZE = "int4_asym", 32
#: Block sizes bitsandbytes supports for 4-bit quantization.
BNB_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: Rows are quantized in slices of at most this many weights (bounds the temporaries).
QUANTIZE_CHUNK_ELEMENTS = 1 << 18
#: Integer dtype as wide as two values of a float dtype: a byte's two codes are then looked up as one.
_PAIR_AS_INT = {4: torch.int64, 2: torch.int32}
_REGISTRY: dict[str, StoredFormat] = {}


@dataclass(frozen=True)
class Packed:
    """A compressed weight: ``codes`` uint8 ``(out, in // codes_per_byte)``, ``scales`` ``(out, in // group_size)``
    and, for the asymmetric formats, ``mins`` of the same shape as ``scales``."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scales) if self.mins is None else (self.codes, self.scales, self.mins)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def select_rows(packed: Packed, index: torch.Tensor | slice) -> Packed:
    """The compressed rows ``index`` of ``packed`` (an embedding lookup or an output chunk)."""
    mins = packed.mins[index] if packed.mins is not None else None
    return Packed(packed.codes[index], packed.scales[index], mins)


def get_format(fmt: str | StoredFormat) -> StoredFormat:
    """The stored format named ``fmt`` (``"auto"``: the one float weights are quantized to).

    Example::

        >>> get_format("int4").bits_per_weight(32)
        5.0
    """
    if isinstance(fmt, StoredFormat):
        return fmt
    name = AUTO_FLOAT_FORMAT if fmt == "auto" else fmt
    if name not in _REGISTRY:
        raise ValueError(f"Unknown stored format {fmt!r}; known: {', '.join(sorted(_REGISTRY))}.")
    return _REGISTRY[name]


def validate_format(fmt: str, group_size: int) -> None:
    """Fail fast on an unknown ``fmt``, a bad ``group_size`` or a missing bitsandbytes.

    Raises:
        ValueError: unknown ``fmt`` or unsupported ``group_size``.
        ModuleNotFoundError: ``fmt`` is ``"nf4"``/``"fp4"`` and bitsandbytes is not installed.
    """
    if fmt not in FORMATS:
        raise ValueError(f"`fmt={fmt!r}` is not supported; choose one of {', '.join(map(repr, FORMATS))}.")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2 or group_size % 2:
        raise ValueError(f"`group_size` must be an even integer >= 2, got {group_size!r}.")
    get_format(fmt).validate(group_size)


class StoredFormat:
    """Integer codes, a scale per group and, if ``asymmetric``, a minimum: ``value(code) * scale (+ minimum)``.

    A subclass sets the class attributes; one with a ``name`` is registered as a singleton.

    Attributes:
        name: What ``CompressedLinear.fmt`` and the logs call it.
        code_bits: Bits of one code's value. Up to 4 they are packed two a byte, else one a byte.
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
            _REGISTRY[cls.name] = cls()

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
        """Largest round-trip error of one weight, as a fraction of its group's largest magnitude.

        Rounding to the nearest multiple of ``absmax / levels`` errs by at most half a step; the
        asymmetric formats step ``(max - min) / levels <= 2 absmax / levels``. Scales stored in fp16 add
        ``2^-9`` for their rounding.

        Example::

            >>> round(get_format("int4").error_bound(), 4)
            0.0714
        """
        half_step = 1 / (2**self.code_bits - 1) if self.asymmetric else 0.5 / (2 ** (self.code_bits - 1) - 1)
        return half_step + (2.0**-9 if self.scale_dtype == torch.float16 else 0.0)

    def allocate(self, shapes: list[tuple[int, int]], group_size: int, device: torch.device | str = "cpu") -> list[Packed]:
        """Empty :class:`Packed` tensors for weights of ``shapes``, all views of one byte buffer.

        One allocation for all codes, scales and minimums: the allocator serves it outside its heap
        (glibc maps allocations this large directly), so the heap holds only the short-lived
        temporaries of quantizing and training and stays small, instead of growing around hundreds of
        compressed tensors placed among those temporaries.

        Example::

            >>> first, second = get_format("int4").allocate([(4, 64), (2, 32)], group_size=32)
            >>> first.codes.shape, second.scales.shape
            (torch.Size([4, 32]), torch.Size([2, 1]))
            >>> first.codes.untyped_storage().data_ptr() == second.codes.untyped_storage().data_ptr()
            True
        """
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
        """Compress a 2-D weight ``(out, in)``; ``group_size`` must divide ``in``. With ``out`` (e.g. a slot
        from :meth:`allocate`) it is written there. Rows go in slices of :data:`QUANTIZE_CHUNK_ELEMENTS` weights.

        Example::

            >>> w = torch.randn(8, 64)
            >>> int4 = get_format("int4")
            >>> p = int4.quantize(w, 32)
            >>> p.codes.shape, p.scales.shape
            (torch.Size([8, 32]), torch.Size([8, 2]))
            >>> bool((int4.dequantize(p, 32, torch.float32) - w).abs().max() < 0.5)
            True
        """
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
        """Decompress to a ``(out, in)`` tensor of ``dtype`` (rows may be any subset, see :func:`select_rows`).

        Args:
            packed: The compressed rows.
            group_size: Weights per scale.
            dtype: Dtype of the result.
            out: Optional ``(out, in)`` tensor of ``dtype`` to write into (no allocation of the result).
            index_buffer: With ``out``, for packed codes: an int32 scratch tensor of shape ``(r, in // 2)``;
                the codes are looked up ``r`` rows at a time (no allocation at all).
        """
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


class Int4(StoredFormat):
    """``int4``, MeBP's: codes ``value + 8`` for ``value`` in -8..7, float32 scale ``absmax / 7``."""

    name = "int4"


def _bnb_functional(fmt: str) -> ModuleType:
    try:
        return importlib.import_module("bitsandbytes.functional")
    except ImportError as err:  # ModuleNotFoundError, or a broken native library
        raise ModuleNotFoundError(
            f"`fmt={fmt!r}` needs bitsandbytes, which could not be imported ({err}). "
            "Use `fmt='int4'` (plain torch, no extra dependency) or `pip install bitsandbytes`."
        ) from err


class _CodeBook(StoredFormat):
    """bitsandbytes' 16-entry code book times the group's float32 ``absmax``: its CUDA kernels on CUDA,
    elsewhere the same rounding in plain torch (bit-identical to its CPU kernel, whose scratch memory
    stays resident across calls) and its values looked up as pairs."""

    signed = False  # the codes are indices into the book

    def validate(self, group_size: int) -> None:
        if group_size not in BNB_GROUP_SIZES:
            raise ValueError(f"`group_size={group_size}` is not a bitsandbytes block size for `fmt={self.name!r}`; "
                             f"choose one of {BNB_GROUP_SIZES} or use `fmt='int4'`.")
        _bnb_functional(self.name)

    def book(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The code book on ``device``, built once (not copied per decompression)."""
        cache: dict[torch.device, torch.Tensor] = self.__dict__.setdefault("_books", {})
        key = torch.device(device)
        if key not in cache:
            cache[key] = _bnb_functional(self.name).get_4bit_type(self.name, device=key)
        return cache[key]

    def code_values(self) -> torch.Tensor:
        return self.book().float()

    def error_bound(self) -> float:
        """Half the widest gap between neighbouring entries of the code book."""
        values = torch.sort(self.code_values() / self.code_values().abs().max()).values
        return float((values[1:] - values[:-1]).max() / 2)

    def quantize(self, weight: torch.Tensor, group_size: int, out: Packed | None = None) -> Packed:
        if weight.device.type != "cuda":
            return super().quantize(weight, group_size, out)
        rows, cols = weight.shape
        out = out or self.allocate([(rows, cols)], group_size, weight.device)[0]
        codes, state = _bnb_functional(self.name).quantize_4bit(
            weight.detach().float().contiguous(), blocksize=group_size, quant_type=self.name)
        out.codes.copy_(codes.reshape(rows, cols // 2))
        out.scales.copy_(state.absmax.float().reshape(rows, cols // group_size))
        return out

    def quantize_into(self, weight: torch.Tensor, group_size: int, out: Packed) -> None:
        rows, cols = weight.shape
        groups = weight.detach().float().reshape(rows, cols // group_size, group_size)
        absmax = groups.abs().amax(dim=-1)
        out.scales.copy_(absmax)
        values, order = torch.sort(self.code_values())
        midpoints = ((values[1:] + values[:-1]) / 2).to(weight.device)
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(-1)
        index = order.to(device=weight.device, dtype=torch.uint8)[torch.bucketize(groups / safe, midpoints)]
        self.store_codes(index.reshape(rows, cols), out)

    def dequantize(self, packed: Packed, group_size: int, dtype: torch.dtype, out: torch.Tensor | None = None,
                   index_buffer: torch.Tensor | None = None) -> torch.Tensor:
        codes = packed.codes
        # bitsandbytes scales in float32 then rounds: the pair table reproduces it bit for bit in float32 only.
        if codes.device.type != "cuda" and dtype == torch.float32:
            return super().dequantize(packed, group_size, dtype, out, index_buffer)
        bnbf = _bnb_functional(self.name)
        native = dtype in (torch.float32, torch.float16, torch.bfloat16)
        state = bnbf.QuantState(absmax=packed.scales.reshape(-1).float(),
                                shape=torch.Size((codes.shape[0], self.columns(packed))), code=self.book(codes.device),
                                blocksize=group_size, quant_type=self.name, dtype=dtype if native else torch.float32)
        if out is not None and native and codes.device.type == "cuda":  # its CUDA kernel writes into `out`
            return bnbf.dequantize_4bit(codes.reshape(-1, 1), state, out=out)
        result = bnbf.dequantize_4bit(codes.reshape(-1, 1), state)
        return out.copy_(result) if out is not None else result.to(dtype)


class NF4(_CodeBook):
    """``nf4``: bitsandbytes' normal-float code book."""

    name = "nf4"


class FP4(_CodeBook):
    """``fp4``: bitsandbytes' 4-bit float code book."""

    name = "fp4"


# The GGUF block formats (int4_asym among them) register on import; they subclass StoredFormat above.
from lcsb_lightning.mebp._internal import gguf_blocks  # noqa: E402,F401
