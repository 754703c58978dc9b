"""GGUF block types kept as they are (``fmt="auto"``): each block becomes ``groups_per_block`` groups of a stored
format that dequantize bit for bit as ``gguf.quants.dequantize`` does; the K-quants' ``d * sc`` sub-block scales
are exact in float32. The table of types, codes and bits a weight: docs/mebp.md, "Formats".
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from lcsb_lightning.mebp._internal.stored import Packed, StoredFormat

#: Blocks whose sub-block scales are taken apart at once by :func:`_factor` (bounds its temporaries).
_FACTOR_BLOCKS = 1024


def _f16(raw: np.ndarray) -> np.ndarray:
    """``(n, 2)`` bytes -> ``(n, 1)`` float32 of the fp16 they hold."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _fields(packed: np.ndarray, width: int, run: int) -> np.ndarray:
    """Unpack ``width``-bit fields: in each run of ``run`` bytes, field ``k`` of byte ``j`` is value ``k * run + j``."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(1, 1, -1, 1)
    fields = (packed.reshape(packed.shape[0], -1, 1, run) >> shifts) & np.uint8((1 << width) - 1)
    return fields.reshape(packed.shape[0], -1).astype(np.int16)


def _pack_fields(values: np.ndarray, width: int, run: int) -> np.ndarray:
    """The inverse of :func:`_fields` (``values`` already below ``2**width``)."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(1, 1, -1, 1)
    parts = values.astype(np.uint8).reshape(values.shape[0], -1, 8 // width, run) << shifts
    return np.bitwise_or.reduce(parts, axis=2).reshape(values.shape[0], -1)


def _factor(x: np.ndarray, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    """An fp16 ``d`` and integers ``q`` in ``low..high`` with ``d * q == x`` exactly, per row of ``x``
    (a K-quant block's sub-block scales): ``d`` is the peak over each candidate integer.

    Raises:
        ValueError: a row is no fp16 times such integers (the scales did not come from these blocks).
    """
    if len(x) > _FACTOR_BLOCKS:
        parts = [_factor(x[at : at + _FACTOR_BLOCKS], low, high) for at in range(0, len(x), _FACTOR_BLOCKS)]
        return np.concatenate([d for d, _ in parts]), np.concatenate([q for _, q in parts])
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    candidates = np.array([c for c in range(low, high + 1) if c], dtype=np.float32)
    d = (peak / candidates).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.round(x[:, None, :] / d[:, :, None])
    fits = np.all((d[:, :, None] * q == x[:, None, :]) & (q >= low) & (q <= high), axis=2)
    zero = peak[:, 0] == 0
    if not np.all(fits.any(axis=1) | zero):
        raise ValueError(f"scales that are no fp16 times integers in {low}..{high}: not this GGUF type's blocks")
    pick, rows = fits.argmax(axis=1), np.arange(len(x))
    return np.where(zero, 0, d[rows, pick]), np.where(zero[:, None], 0, q[rows, pick]).astype(np.int16)


class GGUFBlocks(StoredFormat):
    """A stored format holding a GGUF block type as it is; ``block_geometry`` comes from ``gguf.GGML_QUANT_SIZES``."""

    groups_per_block: ClassVar[int] = 1

    @property
    def block_geometry(self) -> tuple[int, int]:
        """``(weights, bytes)`` of one block."""
        import gguf

        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.gguf_type]]

    @property
    def group_size(self) -> int:
        return self.block_geometry[0] // self.groups_per_block

    def decode(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(n, bytes)`` blocks -> code values ``(n, weights)``, scales and minimums (None) ``(n, groups)``."""
        raise NotImplementedError

    def encode(self, values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
        """The inverse of :meth:`decode`."""
        raise NotImplementedError

    def read_gguf(self, raw: np.ndarray, out: Packed) -> None:
        """Write raw GGUF rows ``(rows, row bytes)`` of this type into the slot ``out`` of the same rows."""
        rows = raw.shape[0]
        values, scales, mins = self.decode(np.ascontiguousarray(raw).reshape(-1, self.block_geometry[1]))
        out.scales.copy_(torch.from_numpy(np.ascontiguousarray(scales)).view(rows, -1))
        if mins is not None:
            assert out.mins is not None
            out.mins.copy_(torch.from_numpy(np.ascontiguousarray(mins)).view(rows, -1))
        self.store_codes(torch.from_numpy(values).view(rows, -1), out)

    def to_gguf(self, packed: Packed) -> np.ndarray:
        """The raw GGUF rows ``(rows, row bytes)`` of ``packed`` (stored at :attr:`group_size`).

        Raises:
            ValueError: another group size, or K-quant scales that are no fp16 times the type's integers.
        """
        codes, (rows, cols) = packed.codes.cpu(), (packed.codes.shape[0], self.columns(packed))
        if packed.scales.shape[1] * self.group_size != cols:
            raise ValueError(f"{self.name} holds {self.gguf_type} blocks at group {self.group_size}, "
                             f"not {cols // packed.scales.shape[1]}.")
        if self.codes_per_byte == 1:
            values = (codes.view(torch.int8) if self.signed else codes).to(torch.int16)
        else:
            values = torch.stack((codes >> 4, codes & 15), dim=-1).reshape(rows, cols).to(torch.int16) - 8 * self.signed
        groups = self.groups_per_block

        def per_block(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.cpu().float().numpy().reshape(-1, groups)

        blocks = self.encode(values.numpy().reshape(-1, self.block_geometry[0]), per_block(packed.scales),
                             per_block(packed.mins))
        return blocks.reshape(rows, -1)


class _Legacy(GGUFBlocks):
    """The 32-weight types: an fp16 ``d`` (and ``m``), Q5's 32 fifth bits, then the codes
    (weight ``j`` in the low nibble of byte ``j``, weight ``j + 16`` in its high nibble)."""

    scale_dtype = torch.float16

    def decode(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]) if self.asymmetric else None
        rest = blocks[:, 2 + 2 * self.asymmetric :]
        if self.code_bits == 8:
            return np.ascontiguousarray(rest).view(np.int8).astype(np.int16), d, m
        q = _fields(rest[:, -16:], 4, 16)
        if self.code_bits == 5:
            q |= np.unpackbits(rest[:, :4], axis=1, bitorder="little") << 4
        return q - (2 ** (self.code_bits - 1) if self.signed else 0), d, m

    def encode(self, values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
        parts = [_f16_bytes(scales)] + ([_f16_bytes(mins)] if mins is not None else [])
        if self.code_bits == 8:
            return np.concatenate([*parts, values.astype(np.int8).view(np.uint8)], axis=1)
        unsigned = (values + (2 ** (self.code_bits - 1) if self.signed else 0)).astype(np.uint8)
        if self.code_bits == 5:
            parts.append(np.packbits(unsigned >> 4, axis=1, bitorder="little"))
        return np.concatenate([*parts, _pack_fields(unsigned & 15, 4, 16)], axis=1)


class Q4_0(_Legacy):
    """``q4_0``: GGUF Q4_0, 4-bit codes of ``q - 8`` with an fp16 scale."""

    name, gguf_type = "q4_0", "Q4_0"


class Int4Asym(_Legacy):
    """``int4_asym``: unsigned 4-bit codes, an fp16 scale ``(max - min) / 15`` and minimum; GGUF Q4_1."""

    name, gguf_type, signed, asymmetric = "int4_asym", "Q4_1", False, True


class Q5_0(_Legacy):
    """``q5_0``: GGUF Q5_0, 5-bit signed codes ``q - 16`` one a byte, fp16 scale."""

    name, gguf_type, code_bits = "q5_0", "Q5_0", 5


class Q5_1(_Legacy):
    """``q5_1``: GGUF Q5_1, unsigned 5-bit codes one a byte, fp16 scale and minimum."""

    name, gguf_type, code_bits, signed, asymmetric = "q5_1", "Q5_1", 5, False, True


class Q8_0(_Legacy):
    """``q8_0``: GGUF Q8_0, 8-bit signed codes, fp16 scale."""

    name, gguf_type, code_bits = "q8_0", "Q8_0", 8


class Q2_K(GGUFBlocks):
    """``q2_k``: GGUF Q2_K, 2-bit codes (stored as 4-bit ones) per 16 weights, float32 ``d*sc`` and ``-dmin*m``."""

    name, gguf_type, code_bits, signed, asymmetric, groups_per_block = "q2_k", "Q2_K", 2, False, True, 16

    def decode(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        sc, d, dmin = blocks[:, :16], _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
        return _fields(blocks[:, 16:80], 2, 32), d * (sc & 15).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))

    def encode(self, values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
        assert mins is not None
        (d, sc), (dmin, m) = _factor(scales, 0, 15), _factor(-mins, 0, 15)
        return np.concatenate([(sc | m << 4).astype(np.uint8), _pack_fields(values, 2, 32), _f16_bytes(d),
                               _f16_bytes(dmin)], axis=1)


class Q3_K(GGUFBlocks):
    """``q3_k``: GGUF Q3_K, signed 3-bit codes (stored as 4-bit ones) per 16 weights, float32 ``d*(sc - 32)``."""

    name, gguf_type, code_bits, groups_per_block = "q3_k", "Q3_K", 3, 16

    def decode(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        hmask, qs, packed_scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
        sc = (_fields(packed_scales[:, :8], 4, 8) | (_fields(packed_scales[:, 8:], 2, 4) << 4)) - 32
        return _fields(qs, 2, 32) - 4 * (1 - _fields(hmask, 1, 32)), d * sc.astype(np.float32), None

    def encode(self, values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
        d, sc = _factor(scales, -32, 31)
        sc, unsigned = sc + 32, values + 4
        packed_scales = [_pack_fields(sc & 15, 4, 8), _pack_fields(sc >> 4, 2, 4)]
        return np.concatenate([_pack_fields(unsigned >> 2, 1, 32), _pack_fields(unsigned & 3, 2, 32), *packed_scales,
                               _f16_bytes(d)], axis=1)


class Q4_K(GGUFBlocks):
    """``q4_k``: GGUF Q4_K, unsigned 4-bit codes per 32 weights, float32 ``d*sc`` and ``-dmin*m`` (6-bit sc, m)."""

    name, gguf_type, signed, asymmetric, groups_per_block = "q4_k", "Q4_K", False, True, 8

    def decode(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        from gguf.quants import Q4_K as GGUFQ4K

        d, dmin, (sc, m) = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), GGUFQ4K.get_scale_min(blocks[:, 4:16])
        q = _fields(blocks[:, -128:], 4, 32)
        if self.code_bits == 5:
            q |= _fields(blocks[:, 16:48], 1, 32) << 4
        return q, d * sc.astype(np.float32), -(dmin * m.astype(np.float32))

    def encode(self, values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
        assert mins is not None
        (d, sc), (dmin, m) = _factor(scales, 0, 63), _factor(-mins, 0, 63)
        low, high = sc[:, 4:] & 15 | (m[:, 4:] & 15) << 4, [sc[:, :4] | sc[:, 4:] >> 4 << 6, m[:, :4] | m[:, 4:] >> 4 << 6]
        packed_scales = np.concatenate([*high, low], axis=1).astype(np.uint8)
        high_bits = [_pack_fields(values >> 4, 1, 32)] if self.code_bits == 5 else []
        return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed_scales, *high_bits,
                               _pack_fields(values & 15, 4, 32)], axis=1)


class Q5_K(Q4_K):
    """``q5_k``: GGUF Q5_K, unsigned 5-bit codes one a byte per 32 weights, float32 ``d*sc`` and ``-dmin*m``."""

    name, gguf_type, code_bits = "q5_k", "Q5_K", 5


class Q6_K(GGUFBlocks):
    """``q6_k``: GGUF Q6_K, signed 6-bit codes ``q - 32`` one a byte per 16 weights, float32 ``d*sc`` (8-bit sc)."""

    name, gguf_type, code_bits, groups_per_block = "q6_k", "Q6_K", 6, 16

    def decode(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        sc, d = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8), _f16(blocks[:, 208:210])
        q = (_fields(blocks[:, :128], 4, 64) | (_fields(blocks[:, 128:192], 2, 32) << 4)) - 32
        return q, d * sc.astype(np.float32), None

    def encode(self, values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
        d, sc = _factor(scales, -128, 127)
        unsigned = values + 32
        return np.concatenate([_pack_fields(unsigned & 15, 4, 64), _pack_fields(unsigned >> 4, 2, 32),
                               sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)
