"""``update_scale="sqrt_period"``: each block's optimizer update is multiplied by sqrt(steps per selection)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lcsb_lightning import LCSBCallback
from lcsb_lightning.controller import LCSBController, validate_modes
from lcsb_lightning.policies import DyadicPolicy
from tests.conftest import ResidualNet, TokenLM, quiet_trainer, token_batches


def _step(model: nn.Module, controller: LCSBController, optimizer: torch.optim.Optimizer, step: int) -> None:
    controller.begin_step(step, [optimizer])
    tokens = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(step))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    controller.before_optimizer_step(optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _run(update_scale: str, steps: int) -> tuple[nn.Module, LCSBController]:
    torch.manual_seed(0)
    model = ResidualNet(num_blocks=8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    controller = LCSBController(model, DyadicPolicy(levels=4), update_scale=update_scale)
    controller.scale_updates_of([optimizer])
    for step in range(steps):
        _step(model, controller, optimizer, step)
    return model, controller


def test_multipliers_are_the_square_root_of_each_blocks_period() -> None:
    _, controller = _run("sqrt_period", 16)
    # dyadic over 8 blocks, 16 steps: the top block every step, the next every 2nd, 2 blocks every 4th,
    # the bottom 4 every 8th
    assert controller.selection_counts == [2, 2, 2, 2, 4, 4, 8, 16]
    assert controller.update_multipliers() == pytest.approx([math.sqrt(8)] * 4 + [2.0, 2.0, math.sqrt(2), 1.0])
    controller.release()


def test_each_blocks_update_is_scaled_exactly() -> None:
    plain, plain_ctl = _run("none", 9)
    scaled, scaled_ctl = _run("sqrt_period", 9)
    plain_ctl.release()
    # one more step from the same state, scaled and not: the scaled update is factor x the plain one
    scaled_ctl.release()
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    scaled.load_state_dict(plain.state_dict())
    for model in (plain, scaled):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        controller = LCSBController(model, DyadicPolicy(levels=4), update_scale="sqrt_period" if model is scaled else "none")
        controller.load_state_dict(scaled_ctl.state_dict())
        controller.scale_updates_of([optimizer])
        _step(model, controller, optimizer, 9)
        factors = controller.update_multipliers()
        controller.release()
    params = dict(scaled.named_parameters())
    for name, p in plain.named_parameters():
        if not p.requires_grad:
            continue
        block = int(name.split(".")[1])
        expected = before[name] + factors[block] * (p.detach() - before[name])
        torch.testing.assert_close(params[name].detach(), expected, rtol=1e-5, atol=1e-7)
    assert max(factors) > 1.0


def test_a_step_without_gradients_stays_unscaled() -> None:
    torch.manual_seed(0)
    model = ResidualNet(num_blocks=8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    controller = LCSBController(model, DyadicPolicy(levels=4), update_scale="sqrt_period")
    controller.scale_updates_of([optimizer])
    for step in range(3):
        _step(model, controller, optimizer, step)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    controller.begin_step(3, [optimizer])
    optimizer.zero_grad(set_to_none=True)  # a divergence guard skipped the update
    optimizer.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    controller.release()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"update_scale": "linear"}, "`update_scale='linear'` is not supported; allowed: none, sqrt_period."),
    ({"update_scale": "sqrt_period", "momentum": "skip"}, "needs `momentum='implicit'`, got 'skip'"),
])
def test_bad_update_scale_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        LCSBCallback(**kwargs)


def test_the_callback_scales_updates_in_a_fit() -> None:
    torch.manual_seed(0)
    callback = LCSBCallback(update_scale="sqrt_period", log_every_n_steps=0)
    module = TokenLM(ResidualNet(num_blocks=8))
    quiet_trainer(max_steps=8, callbacks=[callback]).fit(module, token_batches(num_batches=8))
    assert callback.controller is not None
    assert callback.controller.update_multipliers()[0] == pytest.approx(math.sqrt(8))  # trained at step 0 only
    validate_modes("all_reached", "implicit", "sqrt_period")
