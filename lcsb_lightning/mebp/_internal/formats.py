"""Weight formats: quantize a 2-D float weight, dequantize all of it or selected rows.

Every format splits a row into groups of ``group_size`` consecutive weights with one scale each
(and, for the asymmetric formats, one minimum): ``w = value(code) * scale (+ minimum)``.

=============  ====  ===========================================  ======  =====================
format         bits  value of a code                              scale   source
=============  ====  ===========================================  ======  =====================
``int4``       4     ``code - 8``, scale ``absmax / 7``            fp32*   MeBP's format; GGUF Q4_0
``int4_asym``  4     ``code``, scale ``(max - min) / 15`` + min    fp16    GGUF Q4_1
``nf4``/``fp4`` 4    bitsandbytes' code book times ``absmax``      fp32    bitsandbytes
``int8``       8     ``code`` (signed), scale ``absmax / 127``     fp16    GGUF Q8_0, Q5_0
``int8_asym``  8     ``code`` (unsigned), scale + min              fp16    GGUF Q5_1
=============  ====  ===========================================  ======  =====================

(*) ``int4`` taken from a GGUF Q4_0 block keeps the file's fp16 scale. Codes are stored as a uint8
tensor ``(out, in // 2)`` (two 4-bit codes a byte, the first in the high nibble) or ``(out, in)``
(one byte a code); scales and minimums as ``(out, in // group_size)`` tensors, so rows (embedding
lookups, output chunks) can be dequantized on their own. Every format except ``nf4``/``fp4`` on CUDA
dequantizes in plain torch, with float32 products rounded as ``gguf``'s numpy code rounds them
(``value * scale``, then ``+ minimum``): a GGUF block read as it is dequantizes bit for bit equal.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F


class _NoCPUKernelNotice(logging.Filter):
    """Drops bitsandbytes' warning, logged on import on CPUs with AVX512-BF16, that its optional CPU
    4-bit matmul kernel (fetched from the hub by the ``kernels`` package) is missing. Nothing here uses
    it (on CPU the 4-bit formats decompress in plain torch), and peft imports bitsandbytes in every
    LoRA run, 4-bit or not."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


def _quiet_bitsandbytes_cpu_notice() -> None:
    # On the logger that emits it: a filter on the "bitsandbytes" parent would not see its children's records.
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(existing, _NoCPUKernelNotice) for existing in logger.filters):
        logger.addFilter(_NoCPUKernelNotice())


_quiet_bitsandbytes_cpu_notice()


#: Formats accepted by ``fmt=``. ``auto`` keeps a GGUF file's blocks in the stored format they map to
#: (:data:`lcsb_lightning.mebp._internal.gguf_blocks.NATIVE_FORMATS`) and uses :data:`AUTO_FLOAT_FORMAT`
#: for float weights.
FORMATS: tuple[str, ...] = ("auto", "int4", "int4_asym", "nf4", "fp4")
#: Formats a compressed tensor is stored in (``int8``/``int8_asym`` come only from GGUF blocks).
STORED_FORMATS: tuple[str, ...] = ("int4", "int4_asym", "nf4", "fp4", "int8", "int8_asym")
#: What ``fmt="auto"`` quantizes float weights to: the lowest error measured at 5 bits a weight or
#: fewer on SmolLM2-135M's matrices (docs/mebp.md, "Formats"; tests/test_mebp_format_table.py).
AUTO_FLOAT_FORMAT = "int4_asym"
#: Block sizes bitsandbytes supports for 4-bit quantization.
BNB_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
_BNB_FORMATS = ("nf4", "fp4")
_EIGHT_BIT = ("int8", "int8_asym")
_ASYMMETRIC = ("int4_asym", "int8_asym")


def stored_format(fmt: str) -> str:
    """The format float weights are quantized to for ``fmt`` (``auto`` -> :data:`AUTO_FLOAT_FORMAT`)."""
    return AUTO_FLOAT_FORMAT if fmt == "auto" else fmt


def codes_per_byte(fmt: str) -> int:
    """2 for the 4-bit formats, 1 for the 8-bit ones."""
    return 1 if fmt in _EIGHT_BIT else 2


def scale_dtype(fmt: str) -> torch.dtype:
    """The dtype scales (and minimums) of ``fmt`` are stored in when quantized here (GGUF's fp16, or float32)."""
    return torch.float16 if fmt in ("int4_asym", *_EIGHT_BIT) else torch.float32


def bits_per_weight(fmt: str, group_size: int) -> float:
    """Stored bits of one weight: its code plus its share of the group's scale (and minimum)."""
    scale_bits = torch.finfo(scale_dtype(fmt)).bits * (2 if fmt in _ASYMMETRIC else 1)
    return 8 / codes_per_byte(fmt) + scale_bits / group_size


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
    if fmt in _BNB_FORMATS:
        if group_size not in BNB_GROUP_SIZES:
            raise ValueError(
                f"`group_size={group_size}` is not a bitsandbytes block size for `fmt={fmt!r}`; "
                f"choose one of {BNB_GROUP_SIZES} or use `fmt='int4'`."
            )
        _bnb_functional(fmt)


def _bnb_functional(fmt: str) -> ModuleType:
    try:
        return importlib.import_module("bitsandbytes.functional")
    except ImportError as err:  # ModuleNotFoundError, or a broken native library
        raise ModuleNotFoundError(
            f"`fmt={fmt!r}` needs bitsandbytes, which could not be imported ({err}). "
            "Use `fmt='int4'` (plain torch, no extra dependency) or `pip install bitsandbytes`."
        ) from err


@dataclass(frozen=True)
class Packed:
    """Compressed weight: ``codes`` uint8 ``(out, in // codes_per_byte)``, ``scales`` ``(out, in // group_size)``
    and, for the asymmetric formats, ``mins`` of the same shape as ``scales``."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scales) if self.mins is None else (self.codes, self.scales, self.mins)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def weight_columns(packed: Packed, fmt: str) -> int:
    """Input features of the weight ``packed`` holds."""
    return packed.codes.shape[1] * codes_per_byte(fmt)


#: Rows are quantized in slices of at most this many weights (bounds the temporaries).
QUANTIZE_CHUNK_ELEMENTS = 1 << 18


def quantize(weight: torch.Tensor, fmt: str, group_size: int, out: Packed | None = None) -> Packed:
    """Compress a 2-D weight ``(out, in)`` to ``fmt`` (``auto``: :func:`stored_format`); ``group_size`` must divide ``in``.

    With ``out`` (e.g. a slot from :func:`allocate_packed`) the codes and scales are written into it.

    ``nf4``/``fp4`` use bitsandbytes' kernel on CUDA and, elsewhere, the same rounding in plain torch
    (bit-identical to bitsandbytes' CPU kernel, whose scratch memory stays resident across calls).
    Rows are processed in slices of :data:`QUANTIZE_CHUNK_ELEMENTS` weights.

    Example::

        >>> w = torch.randn(8, 64)
        >>> p = quantize(w, "int4", 32)
        >>> p.codes.shape, p.scales.shape
        (torch.Size([8, 32]), torch.Size([8, 2]))
        >>> bool((dequantize(p, "int4", 32, torch.float32) - w).abs().max() < 0.5)
        True
    """
    fmt = stored_format(fmt)
    if weight.dim() != 2:
        raise ValueError(f"Expected a 2-D weight, got shape {tuple(weight.shape)}.")
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"`group_size={group_size}` does not divide the weight's {cols} columns.")
    if out is None:
        (out,) = allocate_packed([(rows, cols)], group_size, weight.device, fmt)
    if fmt in _BNB_FORMATS and weight.device.type == "cuda":
        bnbf = _bnb_functional(fmt)
        codes, state = bnbf.quantize_4bit(weight.detach().float().contiguous(), blocksize=group_size, quant_type=fmt)
        out.codes.copy_(codes.reshape(rows, cols // 2))
        out.scales.copy_(state.absmax.float().reshape(rows, cols // group_size))
        return out
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        quantize_into(weight[start:stop], fmt, group_size, select_rows(out, slice(start, stop)))
    return out


def allocate_packed(
    shapes: list[tuple[int, int]],
    group_size: int,
    device: torch.device | str = "cpu",
    fmt: str = "int4",
    scales_dtype: torch.dtype | None = None,
) -> list[Packed]:
    """Empty :class:`Packed` tensors in ``fmt`` for weights of ``shapes``, all views of one byte buffer.

    One allocation for all codes, scales and minimums: the allocator serves it outside its heap
    (glibc maps allocations this large directly), so the heap holds only the short-lived
    temporaries of quantizing and training and stays small, instead of growing around hundreds of
    compressed tensors placed among those temporaries. ``scales_dtype`` overrides :func:`scale_dtype`
    (a GGUF Q4_0 block keeps its fp16 scale in ``int4``).

    Example::

        >>> first, second = allocate_packed([(4, 64), (2, 32)], group_size=32)
        >>> first.codes.shape, second.scales.shape
        (torch.Size([4, 32]), torch.Size([2, 1]))
        >>> first.codes.untyped_storage().data_ptr() == second.codes.untyped_storage().data_ptr()
        True
    """
    fmt = stored_format(fmt)
    per_byte = codes_per_byte(fmt)
    dtype = scales_dtype or scale_dtype(fmt)
    parts: list[tuple[int, int, int]] = []  # (rows, cols, n_groups) per weight
    for rows, cols in shapes:
        if cols % group_size or cols % per_byte:
            raise ValueError(f"`group_size={group_size}` does not divide a weight's {cols} columns.")
        parts.append((rows, cols, rows * cols // group_size))
    n_tensors = 3 if fmt in _ASYMMETRIC else 2
    align = 8  # every view starts on an 8-byte boundary, so it can be viewed as any dtype
    sizes = [[rows * cols // per_byte, groups * dtype.itemsize, groups * dtype.itemsize][:n_tensors]
             for rows, cols, groups in parts]
    total = sum(-(-size // align) * align for weight in sizes for size in weight)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    out: list[Packed] = []
    at = 0

    def take(nbytes: int) -> torch.Tensor:
        nonlocal at
        view, at = buffer[at : at + nbytes], at + -(-nbytes // align) * align
        return view

    for (rows, cols, groups), weight_sizes in zip(parts, sizes):
        codes = take(weight_sizes[0]).view(rows, cols // per_byte)
        scales = take(weight_sizes[1]).view(dtype).view(rows, groups // rows)
        mins = take(weight_sizes[2]).view(dtype).view(rows, groups // rows) if n_tensors == 3 else None
        out.append(Packed(codes, scales, mins))
    return out


def quantize_into(weight: torch.Tensor, fmt: str, group_size: int, out: Packed) -> None:
    """Quantize ``weight`` ``(rows, in)`` into the slot ``out`` of the same rows.

    Each group is rounded to its nearest code: multiples of ``absmax / 7`` (``int4``) or
    ``absmax / 127`` (``int8``), ``(max - min) / 15`` steps above the minimum (``int4_asym``), or
    bitsandbytes' code book scaled by ``absmax`` (``nf4``/``fp4``, in plain torch). Scales stored in
    fp16 are rounded first and the codes chosen against the rounded values.
    """
    fmt = stored_format(fmt)
    w = weight.detach().float()
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group_size, group_size)
    if fmt in _ASYMMETRIC:
        levels = 15 if fmt == "int4_asym" else 255
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        assert out.mins is not None
        out.mins.copy_(low)
        out.scales.copy_((high - low) / levels)
        minimum, scale = out.mins.float().unsqueeze(-1), out.scales.float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        index = torch.round((groups - minimum) / safe).clamp_(0, levels).to(torch.uint8)
    elif fmt in ("int4", "int8"):
        levels = 7 if fmt == "int4" else 127
        out.scales.copy_(groups.abs().amax(dim=-1) / levels)
        scale = out.scales.float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        index = torch.round(groups / safe).clamp_(-levels - (fmt == "int4"), levels)
        index = index.add_(8).to(torch.uint8) if fmt == "int4" else index.to(torch.int8).view(torch.uint8)
    else:
        absmax = groups.abs().amax(dim=-1)
        out.scales.copy_(absmax)
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        values, order = _code_book_order(fmt, w.device)
        midpoints = (values[1:] + values[:-1]) / 2
        index = order[torch.bucketize(groups / safe.unsqueeze(-1), midpoints)]
    index = index.reshape(rows, cols)
    out.codes.copy_(index if codes_per_byte(fmt) == 1 else (index[:, 0::2] << 4) | index[:, 1::2])


def _code_book_order(fmt: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' ``fmt`` code book sorted, and each sorted entry's code (uint8)."""
    values, order = torch.sort(_code_book(fmt, torch.device("cpu")).float())
    return values.to(device), order.to(device=device, dtype=torch.uint8)


def dequantize(
    packed: Packed,
    fmt: str,
    group_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    index_buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decompress to a ``(out, in)`` tensor of ``dtype`` (rows may be any subset, see :func:`select_rows`).

    Args:
        packed: The compressed rows.
        fmt: Their stored format (``auto``: :func:`stored_format`).
        group_size: Weights per scale.
        dtype: Dtype of the result.
        out: Optional ``(out, in)`` tensor of ``dtype`` to write into (no allocation of the result).
        index_buffer: With ``out``, for a 4-bit format: an int32 scratch tensor of shape
            ``(r, in // 2)``; the codes are looked up ``r`` rows at a time (no allocation at all).
    """
    fmt = stored_format(fmt)
    codes, scales = packed.codes, packed.scales
    rows, cols = codes.shape[0], weight_columns(packed, fmt)
    if out is not None and (tuple(out.shape) != (rows, cols) or out.dtype != dtype):
        raise ValueError(f"`out` must be a {(rows, cols)} tensor of {dtype}, got {tuple(out.shape)} {out.dtype}.")
    # bitsandbytes scales in float32 then rounds: the table reproduces it bit for bit in float32 only.
    if fmt not in _BNB_FORMATS or (codes.device.type != "cuda" and dtype == torch.float32):
        if out is None:
            out = torch.empty(rows, cols, dtype=dtype, device=codes.device)
        return _dequantize_plain(packed, fmt, group_size, out, index_buffer)
    bnbf = _bnb_functional(fmt)
    native = dtype in (torch.float32, torch.float16, torch.bfloat16)
    state = bnbf.QuantState(
        absmax=scales.reshape(-1).float(),
        shape=torch.Size((rows, cols)),
        code=_code_book(fmt, codes.device),
        blocksize=group_size,
        quant_type=fmt,
        dtype=dtype if native else torch.float32,
    )
    if out is not None and native and codes.device.type == "cuda":  # its CUDA kernel writes into `out`
        return bnbf.dequantize_4bit(codes.reshape(-1, 1), state, out=out)
    result = bnbf.dequantize_4bit(codes.reshape(-1, 1), state)
    return out.copy_(result) if out is not None else result.to(dtype)


#: Integer dtype as wide as two values of a float dtype: a byte's two codes are then looked up as one.
_PAIR_AS_INT = {4: torch.int64, 2: torch.int32}


def _dequantize_plain(
    packed: Packed, fmt: str, group_size: int, out: torch.Tensor, index_buffer: torch.Tensor | None
) -> torch.Tensor:
    """Every format in plain torch, writing into ``out``: each code's value, times the scale, plus the minimum."""
    codes, scales = packed.codes, packed.scales
    rows, cols = out.shape
    if codes_per_byte(fmt) == 1:
        out.copy_(codes.view(torch.int8) if fmt == "int8" else codes)
    else:
        pairs = _code_pairs(fmt, codes.device, out.dtype)
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
    grouped.mul_(scales.to(out.dtype).unsqueeze(-1))
    if packed.mins is not None:  # a separate add: the product is rounded first, as gguf's numpy code does
        grouped.add_(packed.mins.to(out.dtype).unsqueeze(-1))
    return out


_CODE_PAIRS: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}
_CODE_BOOKS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _code_book(fmt: str, device: torch.device) -> torch.Tensor:
    """bitsandbytes' 16-entry ``fmt`` code book on ``device``, built once (not copied per decompression)."""
    key = (fmt, torch.device(device))
    if key not in _CODE_BOOKS:
        _CODE_BOOKS[key] = _bnb_functional(fmt).get_4bit_type(fmt, device=key[1])
    return _CODE_BOOKS[key]


def _code_pairs(fmt: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(256, 2)``: byte ``b`` -> the values of its codes ``b >> 4`` and ``b & 15`` (before scaling).

    ``int4``: ``code - 8``; ``int4_asym``: ``code``; ``nf4``/``fp4``: bitsandbytes' code book (equal
    to its dequantization).
    """
    key = (fmt, torch.device(device), dtype)
    if key not in _CODE_PAIRS:
        byte = torch.arange(256)
        if fmt in ("int4", "int4_asym"):
            values = torch.arange(16, dtype=torch.float32) - (8 if fmt == "int4" else 0)
        else:
            values = _code_book(fmt, torch.device("cpu")).float()
        _CODE_PAIRS[key] = torch.stack((values[byte >> 4], values[byte & 15]), dim=-1).to(device=device, dtype=dtype)
    return _CODE_PAIRS[key]


def select_rows(packed: Packed, index: torch.Tensor | slice) -> Packed:
    """The compressed rows ``index`` of ``packed`` (an embedding lookup or an output chunk)."""
    mins = packed.mins[index] if packed.mins is not None else None
    return Packed(packed.codes[index], packed.scales[index], mins)


def error_bound(fmt: str) -> float:
    """Largest round-trip error of one weight, as a fraction of its group's largest magnitude.

    ``int4`` rounds to the nearest multiple of ``absmax / 7``: at most ``1 / 14``; ``int8`` to
    multiples of ``absmax / 127``; ``int4_asym`` to ``(max - min) / 15`` steps, at most
    ``2 absmax / 30``. Formats with fp16 scales add ``2^-9`` for the rounding of the scale and
    minimum. ``nf4``/``fp4`` round to the nearest entry of their 16-value code book scaled by
    ``absmax``: at most half the widest gap between neighbouring entries (read from bitsandbytes' code book).

    Example::

        >>> round(error_bound("int4"), 4)
        0.0714
    """
    fmt = stored_format(fmt)
    half_step = {"int4": 0.5 / 7.0, "int8": 0.5 / 127.0, "int4_asym": 1.0 / 15.0, "int8_asym": 1.0 / 255.0}
    if fmt in half_step:
        return half_step[fmt] + (2.0**-9 if scale_dtype(fmt) == torch.float16 else 0.0)
    validate_format(fmt, 64)
    code = _bnb_functional(fmt).get_4bit_type(fmt, device="cpu").float()
    values = torch.sort(code / code.abs().max()).values
    return float((values[1:] - values[:-1]).max() / 2)
