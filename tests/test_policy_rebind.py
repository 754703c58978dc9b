"""The policy selects over the blocks that train: when the lowest blocks are frozen (``requires_grad=False``, as
``ProgressiveFreezing`` does), the controller re-binds it over the blocks above, and a resume continues exactly."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from lcsb_lightning import LCSBController
from lcsb_lightning.policies import (
    CyclicPolicy,
    DyadicPolicy,
    FullPolicy,
    GradNormPolicy,
    RandomPolicy,
    SelectionPolicy,
    TopOnlyPolicy,
)
from tests.conftest import ResidualNet

BLOCKS = 8
ALL, TOP4 = tuple(range(8)), (4, 5, 6, 7)


def _steps(controller: LCSBController, model: ResidualNet, steps: range, freeze: dict[int, int]) -> list[tuple[int, ...]]:
    """Train ``steps``; before step ``t`` in ``freeze``, the lowest ``freeze[t]`` blocks stop training."""
    optimizer = torch.optim.SGD(model.stack.parameters(), lr=1e-2)
    tokens = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    selections = []
    for step in steps:
        if step in freeze:
            model.stack[: freeze[step]].requires_grad_(False)
        selections.append(controller.begin_step(step))
        model(tokens).logsumexp(-1).mean().backward()
        controller.before_optimizer_step(optimizer)
        optimizer.step()
        optimizer.zero_grad()
    return selections


# policy, backward, the selections of steps 0-7 with the lowest 4 of 8 blocks frozen from step 4
CASES: dict[str, tuple[Callable[[], SelectionPolicy], str, list[tuple[int, ...]]]] = {
    "cyclic": (lambda: CyclicPolicy(layers_per_step=2), "selected_only", [(0, 1), (2, 3), *[(4, 5), (6, 7)] * 3]),
    # the paper's method: groups of N/4 (2 of 8, then 1 of the 4 that train), the identity path
    "paper": (lambda: CyclicPolicy(fraction=0.25), "identity", [(0, 1), (2, 3), (4, 5), (6, 7), (4,), (5,), (6,), (7,)]),
    # the round under way at the freeze (steps 3-5) is chosen anew over the blocks that train
    "cyclic-switch_every-3": (lambda: CyclicPolicy(layers_per_step=2, switch_every=3), "selected_only",
                              [(0, 1)] * 3 + [(2, 3), (6, 7), (6, 7), (4, 5), (4, 5)]),
    # the ruler over the 4 that train: depths 4, 1, 2, 1 (N/4 of 4 is 1 block)
    "dyadic": (DyadicPolicy, "all_reached", [ALL, (6, 7), TOP4, (6, 7), TOP4, (7,), (6, 7), (7,)]),
    "top_only": (lambda: TopOnlyPolicy(layers_per_step=2), "identity", [(6, 7)] * 8),
    "top_only-more-than-train": (lambda: TopOnlyPolicy(layers_per_step=6), "selected_only",
                                 [(2, 3, 4, 5, 6, 7)] * 4 + [TOP4] * 4),
    "full": (FullPolicy, "identity", [ALL] * 4 + [TOP4] * 4),
    # every block overdue after a round: the oldest of those that train first
    "grad_norm": (lambda: GradNormPolicy(layers_per_step=2, max_staleness=1), "selected_only",
                  [(0, 1), (2, 3), *[(4, 5), (6, 7)] * 3]),
    # frozen (from step 2 here) during the first cycle: it goes on over the blocks that train, then the EMA decides
    "grad_norm-first-cycle": (lambda: GradNormPolicy(layers_per_step=1), "selected_only",
                              [(0,), (1,), (4,), (5,), (6,), (7,), (4,), (5,)]),
}


@pytest.mark.parametrize("case", CASES)
def test_each_policy_selects_over_the_blocks_that_train(case: str) -> None:
    make, backward, expected = CASES[case]
    torch.manual_seed(0)
    model = ResidualNet(BLOCKS)
    controller = LCSBController(model, make(), backward=backward)
    assert _steps(controller, model, range(8), {2 if case.endswith("first-cycle") else 4: 4}) == expected
    assert controller.policy.num_blocks == 4 and controller.trained_from == 4
    controller.release()


def test_random_covers_the_blocks_that_train_in_each_cycle() -> None:
    torch.manual_seed(0)
    model = ResidualNet(BLOCKS)
    controller = LCSBController(model, RandomPolicy(layers_per_step=2, seed=3), backward="identity")
    selections = _steps(controller, model, range(12), {4: 4})
    for cycle in range(4):  # 4 cycles of 2 rounds before the freeze, then of 2 rounds over the 4 that train
        blocks = ALL if cycle < 1 else TOP4
        steps = range(4 * cycle, 4 * cycle + 4) if cycle < 1 else range(2 * cycle + 2, 2 * cycle + 4)
        assert sorted(b for t in steps for b in selections[t]) == list(blocks), (cycle, selections)
    controller.release()


def test_grad_norm_keeps_what_it_learned_of_the_blocks_that_train() -> None:
    policy = GradNormPolicy(layers_per_step=1)
    policy.setup(4)
    for t in range(6):
        policy.observe({i: float(10 * i + t) for i in policy.select(t)})
    ema, last = list(policy.ema), list(policy.last_trained)
    policy.rebind(2)
    assert (policy.ema, policy.last_trained, policy.staleness_bound) == (ema[2:], last[2:], 5)
    policy.rebind(3)  # one block trains again below: measured first
    assert (policy.ema, policy.last_trained) == ([None, *ema[2:]], [-1, *last[2:]])
    assert policy.select(6) == (0,)


def _controller(policy: str, backward: str) -> tuple[LCSBController, ResidualNet]:
    from lcsb_lightning.policies import build_policy

    torch.manual_seed(0)
    model = ResidualNet(BLOCKS)
    kwargs = {} if policy in ("dyadic", "full") else {"layers_per_step": 2, "seed": 1}
    return LCSBController(model, build_policy(policy, **kwargs), backward=backward), model


@pytest.mark.parametrize("frozen_before_load", [True, False], ids=["frozen-before-load", "frozen-after-load"])
@pytest.mark.parametrize(("policy", "backward"), [
    ("cyclic", "identity"), ("random", "selected_only"), ("grad_norm", "selected_only"), ("grad_norm", "all_reached"),
    ("dyadic", "all_reached"), ("top_only", "identity"), ("full", "selected_only"),
])
def test_a_resume_after_a_freeze_continues_the_uninterrupted_selections(policy: str, backward: str,
                                                                        frozen_before_load: bool) -> None:
    """Saved at step 6 (4 blocks frozen from step 3, 6 from step 9) and loaded into a new controller, before or after
    the freeze is restored (``ProgressiveFreezing`` restores it at fit start, before the first batch)."""
    freeze = {3: 4, 9: 6}
    reference, model = _controller(policy, backward)
    expected = _steps(reference, model, range(14), freeze)
    first, model = _controller(policy, backward)
    got = _steps(first, model, range(7), freeze)
    resumed, model = _controller(policy, backward)
    if frozen_before_load:
        model.stack[:4].requires_grad_(False)
    resumed.load_state_dict(first.state_dict())
    got += _steps(resumed, model, range(7, 14), {7: 4, **freeze})
    assert got == expected and resumed.selection_counts == reference.selection_counts
    assert all(min(s) >= 6 for s in got[9:])
    for controller in (reference, first, resumed):
        controller.release()


def test_a_checkpoint_of_0_9_3_rebinds_at_the_next_step() -> None:
    """A controller state saved before the policy was re-bound (no ``trained_from``) loads over every block, and the
    first step re-binds the policy over the blocks that train."""
    controller, model = _controller("cyclic", "identity")
    _steps(controller, model, range(3), {})
    state = controller.state_dict()
    del state["trained_from"]
    resumed, model = _controller("cyclic", "identity")
    resumed.load_state_dict(state)
    assert _steps(resumed, model, range(3, 6), {3: 4}) == [(6, 7), (4, 5), (6, 7)]
