"""The stored formats quantized here from float weights (``fmt=``): ``int4``, ``int4_asym`` (also GGUF Q4_1's
blocks), ``nf4`` and ``fp4`` (bitsandbytes' code books); GGUF block types live in ``gguf_blocks``. Adding a format
is one :class:`~lcsb_lightning.mebp._internal.stored.StoredFormat` subclass: its ``name`` registers it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from lcsb_lightning.mebp._internal.gguf_blocks import GGUFBlocks
from lcsb_lightning.mebp._internal.stored import REGISTRY, Packed, StoredFormat

#: What ``fmt=`` accepts; ``auto`` keeps a GGUF file's blocks where a stored format holds them as they are.
FORMATS: tuple[str, ...] = ("auto", "int4", "int4_asym", "nf4", "fp4")
#: ``fmt="auto"`` on float weights: the lowest error measured at 5 bits a weight or fewer on SmolLM2-135M's
#: matrices (docs/mebp.md, "Formats"; tests/test_mebp_format_table.py).
AUTO_FLOAT_FORMAT, AUTO_GROUP_SIZE = "int4_asym", 32
#: Block sizes bitsandbytes supports for 4-bit quantization.
BNB_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def get_format(fmt: str | StoredFormat) -> StoredFormat:
    """The stored format named ``fmt`` (``"auto"``: the one float weights are quantized to)."""
    if isinstance(fmt, StoredFormat):
        return fmt
    name = AUTO_FLOAT_FORMAT if fmt == "auto" else fmt
    if name not in REGISTRY:
        raise ValueError(f"Unknown stored format {fmt!r}; known: {', '.join(sorted(REGISTRY))}.")
    return REGISTRY[name]


def validate_format(fmt: str, group_size: int) -> None:
    """Fail fast on an unknown ``fmt``, a bad ``group_size`` (ValueError) or a missing bitsandbytes."""
    if fmt not in FORMATS:
        raise ValueError(f"`fmt={fmt!r}` is not supported; choose one of {', '.join(map(repr, FORMATS))}.")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2 or group_size % 2:
        raise ValueError(f"`group_size` must be an even integer >= 2, got {group_size!r}.")
    get_format(fmt).validate(group_size)


def gguf_format(type_name: str) -> GGUFBlocks | None:
    """The stored format holding GGUF tensor type ``type_name`` as it is, or None (read as floats instead)."""
    return next((f for f in REGISTRY.values() if isinstance(f, GGUFBlocks) and f.gguf_type == type_name), None)


class Int4(StoredFormat):
    """``int4``, MeBP's: codes ``value + 8`` for ``value`` in -8..7, float32 scale ``absmax / 7``."""

    name = "int4"


def _bnb_functional(fmt: str) -> ModuleType:
    try:
        return importlib.import_module("bitsandbytes.functional")
    except ImportError as err:  # ModuleNotFoundError, or a broken native library
        raise ModuleNotFoundError(f"`fmt={fmt!r}` needs bitsandbytes, which could not be imported ({err}). Use "
                                  "`fmt='int4'` (plain torch, no extra dependency) or `pip install "
                                  "bitsandbytes`.") from err


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
