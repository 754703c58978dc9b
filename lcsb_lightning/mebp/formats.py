"""4-bit weight formats: quantize a 2-D float weight, dequantize all of it or selected rows.

``int4`` is MeBP's format in plain torch: symmetric, one float32 scale per ``group_size`` consecutive
weights of a row, two 4-bit codes per byte. ``nf4`` and ``fp4`` use bitsandbytes' block-wise
quantization (imported on first use), with ``group_size`` as the block size.

Every format stores a ``(out, in // 2)`` uint8 tensor of codes and a ``(out, in // group_size)``
float32 tensor of scales, so rows (embedding lookups, output chunks) can be dequantized on their own.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

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


def quantize(weight: torch.Tensor, fmt: str, group_size: int) -> Packed:
    """Compress a 2-D weight ``(out, in)``; ``in`` must be divisible by ``group_size``.

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
    w = weight.detach().float()
    if fmt == "int4":
        groups = w.reshape(rows, cols // group_size, group_size)
        scales = groups.abs().amax(dim=-1) / 7.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(groups / safe.unsqueeze(-1)).clamp_(-8, 7).to(torch.int16).add_(8)
        q = q.reshape(rows, cols).to(torch.uint8)
        codes = (q[:, 0::2] << 4) | q[:, 1::2]
        return Packed(codes.contiguous(), scales.contiguous())
    bnbf = _bnb_functional(fmt)
    codes, state = bnbf.quantize_4bit(w.contiguous(), blocksize=group_size, quant_type=fmt)
    return Packed(codes.reshape(rows, cols // 2), state.absmax.float().reshape(rows, cols // group_size))


def dequantize(packed: Packed, fmt: str, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Decompress to a ``(out, in)`` tensor of ``dtype`` (rows may be any subset, see :func:`select_rows`)."""
    codes, scales = packed.codes, packed.scales
    rows, half = codes.shape
    cols = half * 2
    if fmt == "int4":
        # One table lookup turns a byte into its two signed codes (faster than shifting and masking).
        pairs = F.embedding(codes.to(torch.int32), _int4_table(codes.device, dtype))
        w = pairs.reshape(rows, cols // group_size, group_size)
        return w.mul_(scales.to(dtype).unsqueeze(-1)).reshape(rows, cols)
    bnbf = _bnb_functional(fmt)
    state = bnbf.QuantState(
        absmax=scales.reshape(-1).float(),
        shape=torch.Size((rows, cols)),
        code=bnbf.get_4bit_type(fmt, device=codes.device),
        blocksize=group_size,
        quant_type=fmt,
        dtype=torch.float32,
    )
    return bnbf.dequantize_4bit(codes.reshape(-1, 1), state).to(dtype)


_INT4_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _int4_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(256, 2)``: byte ``b`` -> ``(b >> 4) - 8, (b & 15) - 8``."""
    key = (device, dtype)
    if key not in _INT4_TABLES:
        byte = torch.arange(256)
        _INT4_TABLES[key] = (torch.stack((byte >> 4, byte & 15), dim=-1) - 8).to(device=device, dtype=dtype)
    return _INT4_TABLES[key]


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
