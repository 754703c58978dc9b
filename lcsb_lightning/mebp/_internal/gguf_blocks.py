"""GGUF's legacy quantized blocks taken as they are: no float copy, no second quantization.

A GGUF tensor of type Q4_0, Q4_1, Q8_0, Q5_0 or Q5_1 is a sequence of 32-weight blocks, each a fp16
scale ``d`` (Q4_1 and Q5_1: and a fp16 minimum ``m``) followed by the codes. Each block becomes one
group of a stored format (:mod:`~lcsb_lightning.mebp._internal.formats`) with ``group_size=32``:

======  ==============================  ===============  ==========================
GGUF    gguf's dequantization           stored format    bits a weight (file, here)
======  ==============================  ===============  ==========================
Q4_0    ``d * (q - 8)``                 ``int4`` (fp16)   4.5, 4.5
Q4_1    ``d * q + m``                   ``int4_asym``     5.0, 5.0
Q8_0    ``d * q`` (``q`` signed)        ``int8``          8.5, 8.5
Q5_0    ``d * (q - 16)``                ``int8``          5.5, 8.5
Q5_1    ``d * q + m``                   ``int8_asym``     6.0, 9.0
======  ==============================  ===============  ==========================

Only the order of the 4-bit codes changes: a GGUF block keeps weight ``j`` in the low nibble of byte
``j`` and weight ``j + 16`` in its high nibble; the stored formats keep two consecutive weights per
byte. The dequantized weights equal ``gguf.quants.dequantize``'s bit for bit
(``tests/test_mebp_gguf_native.py``). Other types (the K-quants, IQ types, F16, BF16, F32) have no
stored twin here and are read as floats and quantized (``fmt="auto"``: to ``int4_asym``).
"""

from __future__ import annotations

import numpy as np
import torch

from lcsb_lightning.mebp._internal.formats import Packed

#: Weights per GGUF block of the legacy types.
BLOCK = 32
#: Each GGUF type taken as it is, and the stored format it becomes.
NATIVE_FORMATS: dict[str, str] = {"Q4_0": "int4", "Q4_1": "int4_asym", "Q8_0": "int8", "Q5_0": "int8", "Q5_1": "int8_asym"}
#: Bytes of one block: the fp16 scale (and minimum), Q5's 32 high bits, the codes.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24}


def native_format(type_name: str) -> str | None:
    """The stored format a GGUF tensor type is taken into as it is, or None (read as floats instead)."""
    return NATIVE_FORMATS.get(type_name)


def _split_block(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """``(d, m or None, the rest)`` of ``(n, block bytes)`` raw blocks; ``d`` and ``m`` as fp16 ``(n,)``."""
    d = blocks[:, 0:2].copy().view(np.float16).reshape(-1)
    if type_name in ("Q4_1", "Q5_1"):
        return d, blocks[:, 2:4].copy().view(np.float16).reshape(-1), blocks[:, 4:]
    return d, None, blocks[:, 2:]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(n, 16)`` GGUF nibble bytes -> ``(n, 32)`` codes in weight order (low nibbles first, then high)."""
    return np.concatenate((qs & np.uint8(0x0F), qs >> np.uint8(4)), axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """``(n, 4)`` little-endian bytes of Q5's 32 fifth bits -> ``(n, 32)`` bits in weight order."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def read_blocks_into(raw: np.ndarray, type_name: str, out: Packed) -> None:
    """Write raw GGUF rows ``(rows, row bytes)`` of ``type_name`` into the stored slot ``out`` of the same rows."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, _BLOCK_BYTES[type_name])
    d, m, rest = _split_block(blocks, type_name)
    out.scales.copy_(torch.from_numpy(d).view(rows, -1))
    if m is not None:
        assert out.mins is not None
        out.mins.copy_(torch.from_numpy(m).view(rows, -1))
    if type_name == "Q8_0":
        codes = rest
    elif type_name in ("Q4_0", "Q4_1"):
        weights = _nibbles(rest)
        codes = (weights[:, 0::2] << np.uint8(4)) | weights[:, 1::2]
    else:  # Q5_0 / Q5_1: a fifth bit from the 4 bytes before the nibbles
        q = _nibbles(rest[:, 4:]) | (_high_bits(rest[:, :4]) << np.uint8(4))
        codes = (q.astype(np.int8) - np.int8(16)).view(np.uint8) if type_name == "Q5_0" else q
    out.codes.copy_(torch.from_numpy(np.ascontiguousarray(codes)).view(rows, -1))
