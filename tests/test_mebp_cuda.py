"""MeBP's 4-bit layers on CUDA (skipped without a CUDA device): nf4 codes made on the CPU decode alike there, and
``CompressedLinear`` and ``chunked_lm_loss`` match the dequantized weight in values and gradients under bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_nf4_codes_made_on_cpu_decode_alike(dtype: torch.dtype) -> None:
    from lcsb_lightning.mebp._internal.formats import get_format
    from lcsb_lightning.mebp._internal.stored import Packed

    nf4 = get_format("nf4")
    packed = nf4.quantize(torch.randn(96, 128, generator=torch.Generator().manual_seed(0)), 64)  # as load_compressed
    on_cpu = nf4.dequantize(packed, 64, torch.float32)
    on_cuda = nf4.dequantize(Packed(packed.codes.cuda(), packed.scales.cuda()), 64, dtype)
    assert on_cuda.dtype == dtype and on_cuda.device.type == "cuda"
    torch.testing.assert_close(on_cuda.float().cpu(), on_cpu, rtol=1e-2 if dtype == torch.bfloat16 else 0, atol=1e-6)


def test_on_cuda_compressed_linear_and_chunked_loss_match_the_dequantized_weight() -> None:
    from lcsb_lightning.mebp import CompressedLinear, chunked_lm_loss
    from lcsb_lightning.mebp._internal.formats import get_format

    torch.manual_seed(0)
    layer = CompressedLinear.from_linear(torch.nn.Linear(128, 320), "nf4", 64).cuda()
    weight = get_format("nf4").dequantize(layer.packed(), 64, torch.float32)
    x = torch.randn(2, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().sum().backward()
    ref_x = x.detach().float().requires_grad_()
    ref = F.linear(ref_x, weight, layer.bias.float())
    ref.square().sum().backward()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.float(), ref_x.grad, rtol=3e-2, atol=3e-2)
    head = CompressedLinear.from_linear(torch.nn.Linear(128, 320, bias=False), "nf4", 64).cuda()
    labels = torch.randint(0, 320, (1, 16), device="cuda")
    hidden = torch.randn(1, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    loss = chunked_lm_loss(hidden, head, labels, chunk_size=5)
    loss.backward()
    ref_h = hidden.detach().float().requires_grad_()
    logits = F.linear(ref_h, get_format("nf4").dequantize(head.packed(), 64, torch.float32))
    ref_loss = F.cross_entropy(logits[:, :-1].reshape(-1, 320), labels[:, 1:].reshape(-1))
    ref_loss.backward()
    torch.testing.assert_close(loss.float(), ref_loss, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(hidden.grad.float(), ref_h.grad, rtol=2e-2, atol=1e-3)
