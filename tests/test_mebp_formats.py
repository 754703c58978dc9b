"""4-bit formats and the compressed layers: round-trip bounds, exact forward/input-gradient, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lcsb_lightning.mebp._internal.formats import FORMATS, get_format, validate_format
from lcsb_lightning.mebp._internal.stored import select_rows
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", [32, 64])
def test_round_trip_within_documented_bound(fmt: str, group_size: int) -> None:
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    stored = get_format(fmt)
    restored = stored.dequantize(stored.quantize(weight, group_size), group_size, torch.float32)
    group_absmax = weight.reshape(48, -1, group_size).abs().amax(-1, keepdim=True)
    error = (restored - weight).abs().reshape(48, -1, group_size)
    assert torch.all(error <= stored.error_bound() * group_absmax * (1 + 1e-5) + 1e-8)
    assert restored.dtype == torch.float32 and restored.shape == weight.shape


@pytest.mark.parametrize("fmt", FORMATS)
def test_int4_packs_two_weights_per_byte_and_rows_dequantize_alone(fmt: str) -> None:
    weight = torch.randn(10, 64)
    stored = get_format(fmt)
    packed = stored.quantize(weight, 32)
    assert packed.codes.dtype == torch.uint8 and packed.codes.shape == (10, 32)
    assert packed.scales.shape == (10, 2)
    rows = torch.tensor([7, 2, 2])
    full = stored.dequantize(packed, 32, torch.float32)
    assert torch.equal(stored.dequantize(select_rows(packed, rows), 32, torch.float32), full[rows])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("max_chunk_elements", [1 << 24, 64 * 16])  # whole weight / 16-row chunks
def test_compressed_linear_matches_dequantized_reference(fmt: str, max_chunk_elements: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 80)
    layer = CompressedLinear.from_linear(linear, fmt, 32)
    layer.max_chunk_elements = max_chunk_elements
    weight = layer.decompress()
    x = torch.randn(3, 5, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = layer(x)
    ref = F.linear(x_ref, weight, linear.bias.detach())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert not layer.bias.requires_grad and all(not b.requires_grad for b in layer.buffers())


def test_compressed_linear_decompresses_once_per_forward_and_backward() -> None:
    layer = CompressedLinear.from_linear(nn.Linear(64, 8), "int4", 32)
    layer(torch.randn(2, 64, requires_grad=True)).sum().backward()
    assert layer.decompress_count == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("fmt", FORMATS)
def test_compressed_embedding_looks_up_dequantized_rows(fmt: str) -> None:
    embedding = nn.Embedding(20, 64)
    compressed = CompressedEmbedding.from_embedding(embedding, fmt, 64)
    ids = torch.tensor([[3, 19, 0], [3, 3, 7]])
    stored = get_format(fmt)
    table = stored.dequantize(stored.quantize(embedding.weight, 64), 64, torch.float32)
    torch.testing.assert_close(compressed(ids), table[ids])


@pytest.mark.parametrize(
    ("fmt", "group_size", "error", "match"),
    [
        ("int8", 64, ValueError, r"`fmt='int8'` is not supported; choose one of 'auto', 'int4', 'int4_asym', 'nf4', 'fp4'"),
        ("int4", 0, ValueError, r"`group_size` must be an even integer >= 2, got 0"),
        ("int4", 7, ValueError, r"`group_size` must be an even integer >= 2, got 7"),
        ("nf4", 48, ValueError, r"`group_size=48` is not a bitsandbytes block size for `fmt='nf4'`"),
    ],
)
def test_validate_format_errors(fmt: str, group_size: int, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        validate_format(fmt, group_size)


def test_nf4_without_bitsandbytes_says_to_use_int4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.delitem(sys.modules, "bitsandbytes.functional", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"`fmt='nf4'` needs bitsandbytes.*Use `fmt='int4'`.*pip install bitsandbytes"):
        validate_format("nf4", 64)


def test_import_and_int4_work_without_bitsandbytes() -> None:
    code = (
        "import sys; sys.modules['bitsandbytes'] = None\n"
        "import torch, lcsb_lightning.mebp as m\n"
        "from torch import nn\n"
        "net = nn.Module(); net.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))\n"
        "m.apply_mebp(net, fmt='int4', compress_embeddings=False, checkpoint=False)\n"
        "print(type(net.layers[0]).__name__, tuple(net.layers[1](torch.randn(1, 64)).shape))\n"
        "try:\n    m.apply_mebp(net, fmt='fp4')\n"
        "except ModuleNotFoundError as err:\n    print('ERR', err)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CompressedLinear (1, 64)" in result.stdout
    assert "ERR `fmt='fp4'` needs bitsandbytes" in result.stdout
