"""Per-block gradient norms (``grad_norms``, read by the ``grad_norm`` policy): values, devices, reductions.

The sharded (FSDP2, DTensor) case, with its single reduction, runs on two processes in
``tests/test_fsdp.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from lcsb_lightning.blocks import block_grad_norms, grad_norms


def _param(*values: float, device: str = "cpu", grad: bool = True) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(len(values), device=device))
    if grad:
        param.grad = torch.tensor(values, device=device)
    return param


def test_each_block_gets_the_l2_norm_of_its_gradients() -> None:
    blocks = [[_param(3.0), _param(4.0)], [], [_param(1.0, 2.0, 2.0), _param(5.0, grad=False)]]
    assert grad_norms(blocks) == pytest.approx([5.0, 0.0, 3.0])
    assert grad_norms([[_param(1.0, grad=False)], []]) == [0.0, 0.0]


def test_the_norms_of_a_sparse_block_list_stay_on_the_gradients_device() -> None:
    """A block without gradients gets its zero on the gradients' device (``meta`` here, CUDA in
    training), not on the CPU: ``torch.stack`` of the two would fail."""
    blocks = [
        [_param(1.0, device="meta")], [], [_param(1.0, 2.0, device="meta", grad=False)], [_param(2.0, device="meta")]
    ]
    norms = block_grad_norms(blocks)
    assert norms.device.type == "meta" and norms.shape == (4,)


def test_bfloat16_gradients_give_float32_norms() -> None:
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    param.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
    norms = block_grad_norms([[param]])
    assert norms.dtype == torch.float32 and math.isclose(norms.item(), 1.0)
