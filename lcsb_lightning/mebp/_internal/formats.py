"""4-bit weight formats: quantize a 2-D float weight, dequantize all of it or selected rows.

``int4`` is MeBP's format in plain torch: symmetric, one float32 scale per ``group_size`` consecutive
weights of a row, two 4-bit codes per byte. ``nf4`` and ``fp4`` use bitsandbytes' block-wise
quantization (imported on first use), with ``group_size`` as the block size.

Every format stores a ``(out, in // 2)`` uint8 tensor of codes and a ``(out, in // group_size)``
float32 tensor of scales, so rows (embedding lookups, output chunks) can be dequantized on their own.
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


#: Formats accepted by ``fmt=``.
FORMATS: tuple[str, ...] = ("int4", "nf4", "fp4")
#: Block sizes bitsandbytes supports for 4-bit quantization.
BNB_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)


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
    if fmt in ("nf4", "fp4"):
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
    """Compressed weight: ``codes`` uint8 ``(out, in // 2)``, ``scales`` float32 ``(out, in // group_size)``."""

    codes: torch.Tensor
    scales: torch.Tensor


#: Rows are quantized in slices of at most this many weights (bounds the temporaries).
QUANTIZE_CHUNK_ELEMENTS = 1 << 18


def quantize(weight: torch.Tensor, fmt: str, group_size: int, out: Packed | None = None) -> Packed:
    """Compress a 2-D weight ``(out, in)``; ``in`` must be divisible by ``group_size``.

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
    if weight.dim() != 2:
        raise ValueError(f"Expected a 2-D weight, got shape {tuple(weight.shape)}.")
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"`group_size={group_size}` does not divide the weight's {cols} columns.")
    if out is None:
        (out,) = allocate_packed([(rows, cols)], group_size, weight.device)
    if fmt != "int4" and weight.device.type == "cuda":
        bnbf = _bnb_functional(fmt)
        codes, state = bnbf.quantize_4bit(weight.detach().float().contiguous(), blocksize=group_size, quant_type=fmt)
        out.codes.copy_(codes.reshape(rows, cols // 2))
        out.scales.copy_(state.absmax.float().reshape(rows, cols // group_size))
        return out
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        quantize_into(weight[start:stop], fmt, group_size, out.codes[start:stop], out.scales[start:stop])
    return out


def allocate_packed(shapes: list[tuple[int, int]], group_size: int, device: torch.device | str = "cpu") -> list[Packed]:
    """Empty :class:`Packed` tensors for weights of ``shapes``, all views of two contiguous buffers.

    One allocation for all codes and one for all scales: the allocator serves them outside its
    heap (glibc maps allocations this large directly), so the heap holds only the short-lived
    temporaries of quantizing and training and stays small, instead of growing around hundreds of
    compressed tensors placed among those temporaries.

    Example::

        >>> first, second = allocate_packed([(4, 64), (2, 32)], group_size=32)
        >>> first.codes.shape, second.scales.shape
        (torch.Size([4, 32]), torch.Size([2, 1]))
        >>> first.codes.untyped_storage().data_ptr() == second.codes.untyped_storage().data_ptr()
        True
    """
    for rows, cols in shapes:
        if cols % group_size:
            raise ValueError(f"`group_size={group_size}` does not divide a weight's {cols} columns.")
    codes = torch.empty(sum(r * c // 2 for r, c in shapes), dtype=torch.uint8, device=device)
    scales = torch.empty(sum(r * c // group_size for r, c in shapes), dtype=torch.float32, device=device)
    out: list[Packed] = []
    code_at = scale_at = 0
    for rows, cols in shapes:
        n_codes, n_scales = rows * cols // 2, rows * cols // group_size
        out.append(Packed(
            codes[code_at : code_at + n_codes].view(rows, cols // 2),
            scales[scale_at : scale_at + n_scales].view(rows, cols // group_size),
        ))
        code_at, scale_at = code_at + n_codes, scale_at + n_scales
    return out


def quantize_into(weight: torch.Tensor, fmt: str, group_size: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize ``weight`` ``(rows, in)`` into ``codes`` ``(rows, in // 2)`` and ``scales`` ``(rows, in // group_size)``.

    Each group is rounded to its nearest code: multiples of ``absmax / 7`` for ``int4``, bitsandbytes'
    code book scaled by ``absmax`` for ``nf4``/``fp4`` (in plain torch).
    """
    w = weight.detach().float()
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group_size, group_size)
    absmax = groups.abs().amax(dim=-1)
    if fmt == "int4":
        scales.copy_(absmax / 7.0)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        index = torch.round(groups / safe.unsqueeze(-1)).clamp_(-8, 7).add_(8).to(torch.uint8)
    else:
        scales.copy_(absmax)
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        values, order = _code_book_order(fmt, w.device)
        midpoints = (values[1:] + values[:-1]) / 2
        index = order[torch.bucketize(groups / safe.unsqueeze(-1), midpoints)]
    index = index.reshape(rows, cols)
    codes.copy_((index[:, 0::2] << 4) | index[:, 1::2])


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
        fmt: Their format.
        group_size: Weights per scale.
        dtype: Dtype of the result.
        out: Optional ``(out, in)`` tensor of ``dtype`` to write into (no allocation of the result).
        index_buffer: With ``out``: an int32 scratch tensor of shape ``(r, in // 2)``; the codes are
            looked up ``r`` rows at a time (no allocation at all).
    """
    codes, scales = packed.codes, packed.scales
    rows, half = codes.shape
    cols = half * 2
    if out is not None and (tuple(out.shape) != (rows, cols) or out.dtype != dtype):
        raise ValueError(f"`out` must be a {(rows, cols)} tensor of {dtype}, got {tuple(out.shape)} {out.dtype}.")
    # bitsandbytes scales in float32 then rounds: the table reproduces it bit for bit in float32 only.
    if out is not None and (fmt == "int4" or (codes.device.type != "cuda" and dtype == torch.float32)):
        return _dequantize_by_table(packed, fmt, group_size, out, index_buffer)
    if fmt == "int4":
        # One table lookup turns a byte into its two signed codes (faster than shifting and masking).
        w = F.embedding(codes.to(torch.int32), _code_pairs(fmt, codes.device, dtype)).reshape(rows, cols // group_size, group_size)
        return w.mul_(scales.to(dtype).unsqueeze(-1)).reshape(rows, cols)
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


def _dequantize_by_table(
    packed: Packed, fmt: str, group_size: int, out: torch.Tensor, index_buffer: torch.Tensor | None
) -> torch.Tensor:
    """Every format in plain torch, writing into ``out``: byte -> its two code values, times the scale."""
    codes, scales = packed.codes, packed.scales
    rows, cols = out.shape
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
    out.view(rows, cols // group_size, group_size).mul_(scales.to(out.dtype).unsqueeze(-1))
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

    ``int4``: ``code - 8``; ``nf4``/``fp4``: bitsandbytes' code book (equal to its dequantization).
    """
    key = (fmt, torch.device(device), dtype)
    if key not in _CODE_PAIRS:
        byte = torch.arange(256)
        if fmt == "int4":
            values = torch.arange(16, dtype=torch.float32) - 8
        else:
            values = _code_book(fmt, torch.device("cpu")).float()
        _CODE_PAIRS[key] = torch.stack((values[byte >> 4], values[byte & 15]), dim=-1).to(device=device, dtype=dtype)
    return _CODE_PAIRS[key]


def select_rows(packed: Packed, index: torch.Tensor | slice) -> Packed:
    """The compressed rows ``index`` of ``packed`` (an embedding lookup or an output chunk)."""
    return Packed(packed.codes[index], packed.scales[index])


def error_bound(fmt: str) -> float:
    """Largest round-trip error of one weight, as a fraction of its group's largest magnitude.

    ``int4`` rounds to the nearest multiple of ``absmax / 7``: at most ``1 / 14``. ``nf4``/``fp4``
    round to the nearest entry of their 16-value code book scaled by ``absmax``: at most half the
    widest gap between neighbouring entries (read from bitsandbytes' code book).

    Example::

        >>> round(error_bound("int4"), 4)
        0.0714
    """
    if fmt == "int4":
        return 0.5 / 7.0
    validate_format(fmt, 64)
    code = _bnb_functional(fmt).get_4bit_type(fmt, device="cpu").float()
    values = torch.sort(code / code.abs().max()).values
    return float((values[1:] - values[:-1]).max() / 2)
