"""``momentum="reuse"``: a block outside the selection steps with the raw gradient of the last step that trained it."""

from __future__ import annotations

import torch

from lcsb_lightning.controller import LCSBController
from lcsb_lightning.policies import CyclicPolicy
from tests.conftest import tiny_llama_peft


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in params]


def test_a_block_outside_the_selection_gets_its_last_raw_gradient_and_an_untrained_one_zeros() -> None:
    model = tiny_llama_peft(num_layers=4)
    controller = LCSBController(model, CyclicPolicy(layers_per_step=1), backward="selected_only", momentum="reuse")
    blocks = controller.block_params.params_per_block
    optimizer = torch.optim.AdamW([p for params in blocks for p in params], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    raw: dict[int, list[torch.Tensor]] = {}
    for step in range(3):  # cyclic, k=1: blocks 0, 1, 2
        ids = torch.randint(0, 64, (2, 12), generator=generator)
        controller.begin_step(step, [optimizer])
        model(input_ids=ids, labels=ids).loss.backward()
        controller.before_optimizer_step(optimizer)
        raw[step] = _grads(blocks[step])
        if step == 0:
            # clipping scales gradients in place after the hook: what is reused later must stay unclipped
            torch.nn.utils.clip_grad_norm_([p for params in blocks for p in params], max_norm=1e-6)
        else:
            for index in range(step):
                assert all(torch.equal(p.grad, g) for p, g in zip(blocks[index], raw[index]))
            assert all(torch.count_nonzero(p.grad) == 0 for p in blocks[3])  # never trained: a zero gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)  # Lightning's None, and zeroed tensors
    assert any(torch.count_nonzero(g) > 0 for g in raw[0])  # a real gradient was reused, not zeros
    controller.release()


def test_the_remembered_gradients_travel_in_the_state_dict() -> None:
    model = tiny_llama_peft(num_layers=2)
    controller = LCSBController(model, CyclicPolicy(layers_per_step=1), backward="selected_only", momentum="reuse")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    controller.begin_step(0, [optimizer])
    model(input_ids=ids, labels=ids).loss.backward()
    controller.before_optimizer_step(optimizer)
    state = controller.state_dict()
    controller.release()

    fresh = LCSBController(model, CyclicPolicy(layers_per_step=1), backward="selected_only", momentum="reuse")
    fresh.load_state_dict(state)
    assert list(fresh.last_grads) == [0]
    assert all(torch.equal(a, b) for a, b in zip(fresh.last_grads[0], controller.last_grads[0]))
    fresh.release()
