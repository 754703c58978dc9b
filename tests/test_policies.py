from __future__ import annotations

import re
import warnings
from typing import Any, Callable

import pytest

from lcsb_lightning.policies import (
    CyclicPolicy,
    DyadicPolicy,
    FullPolicy,
    GradNormPolicy,
    RandomPolicy,
    SelectionPolicy,
    TopOnlyPolicy,
    available_policies,
    build_policy,
)


@pytest.mark.parametrize(("num_blocks", "k"), [(30, 7), (30, 8), (24, 6), (5, 5), (7, 1), (4, 3)])
def test_cyclic_covers_every_block_once_per_cycle(num_blocks: int, k: int) -> None:
    policy = CyclicPolicy(layers_per_step=k)
    policy.setup(num_blocks)
    groups = policy.num_groups
    for cycle in range(3):
        seen = [b for t in range(cycle * groups, (cycle + 1) * groups) for b in policy.select(t)]
        assert sorted(seen) == list(range(num_blocks))
    assert all(len(policy.select(t)) <= k for t in range(3 * groups, 4 * groups))
    # consecutive groups
    assert all(s == tuple(range(s[0], s[-1] + 1)) for s in (policy.select(t) for t in range(4 * groups, 5 * groups)))


def test_cyclic_switch_every_and_fraction() -> None:
    policy = CyclicPolicy(fraction=0.25, switch_every=3)
    policy.setup(8)
    assert policy.k == 2
    assert [policy.select(t) for t in range(7)] == [(0, 1)] * 3 + [(2, 3)] * 3 + [(4, 5)]


@pytest.mark.parametrize("reshuffle", [True, False])
def test_random_is_reproducible_from_seed(reshuffle: bool) -> None:
    def run(seed: int) -> list[tuple[int, ...]]:
        policy = RandomPolicy(layers_per_step=3, seed=seed, reshuffle=reshuffle)
        policy.setup(10)
        return [policy.select(t) for t in range(20)]

    assert run(0) == run(0)
    assert run(0) != run(1)
    sizes = {len(set(s)) for s in run(0)}
    assert sizes == ({2, 3} if reshuffle else {3})  # reshuffle splits 10 blocks into groups 3, 3, 2, 2


def test_random_reshuffle_covers_every_block_each_cycle() -> None:
    policy = RandomPolicy(layers_per_step=3, seed=5, reshuffle=True)
    policy.setup(10)
    groups = policy.num_groups
    cycles = [sorted(b for t in range(c * groups, (c + 1) * groups) for b in policy.select(t)) for c in range(5)]
    assert all(c == list(range(10)) for c in cycles)


@pytest.mark.parametrize("policy_name", ["random", "grad_norm", "cyclic"])
def test_state_dict_round_trip_continues_the_sequence(policy_name: str) -> None:
    def make():
        p = build_policy(policy_name, layers_per_step=2, seed=3)
        p.setup(7)
        return p

    reference, first = make(), make()
    expected = []
    for t in range(15):
        expected.append(reference.select(t))
        reference.observe({i: float(i * t % 5) for i in expected[-1]})
    for t in range(6):
        first.observe({i: float(i * t % 5) for i in first.select(t)})
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    got = expected[:6]
    for t in range(6, 15):
        got.append(resumed.select(t))
        resumed.observe({i: float(i * t % 5) for i in got[-1]})
    assert got == expected


def test_grad_norm_prefers_high_norm_blocks_yet_respects_the_staleness_bound() -> None:
    num_blocks, k = 12, 3
    policy = GradNormPolicy(layers_per_step=k, exploration=0.05)
    policy.setup(num_blocks)
    norm = {i: (100.0 if i in (2, 7, 9) else 0.01) for i in range(num_blocks)}  # adversarial: 3 dominant blocks
    last = {i: -1 for i in range(num_blocks)}
    longest_gap, counts = 0, [0] * num_blocks
    for t in range(400):
        selected = policy.select(t)
        for i in selected:
            longest_gap = max(longest_gap, t - last[i])
            last[i] = t
            counts[i] += 1
        policy.observe({i: norm[i] for i in selected})
    longest_gap = max([longest_gap] + [400 - last[i] for i in range(num_blocks)])
    assert longest_gap <= policy.staleness_bound
    hot = min(counts[i] for i in (2, 7, 9))
    cold = max(c for i, c in enumerate(counts) if i not in (2, 7, 9))
    assert hot > 2 * cold


#: The keys a policy's checkpoint held in 0.7 and before (no constructor arguments).
KEYS_OF_0_7 = ("round", "selection", "num_blocks", "k")


def _of_0_7(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if key in KEYS_OF_0_7 or key in ("generator", "cycle", "ema",
                                                                                       "last_trained")}


Resume = tuple[Callable[[], SelectionPolicy], Callable[[], SelectionPolicy], str | None, bool, str | None]


# saved, resumed, the one warning (None: none), whether the continuation is the saved run's own, refused with (None: not)
RESUMES: dict[str, Resume] = {
    # the saved generator state decides what follows, not the seed that once made it
    "random-seed": (lambda: RandomPolicy(layers_per_step=2), lambda: RandomPolicy(layers_per_step=2, seed=1),
                    r"checkpoint saved with seed=0 continues under seed=1 \(what it saved stays valid", True, None),
    "random-reshuffle": (lambda: RandomPolicy(layers_per_step=2), lambda: RandomPolicy(layers_per_step=2, reshuffle=False),
                         r"saved with reshuffle=True continues under reshuffle=False", False, None),
    "grad_norm-exploration": (lambda: GradNormPolicy(layers_per_step=2),
                              lambda: GradNormPolicy(layers_per_step=2, exploration=0.0),
                              r"saved with exploration=0.1 continues under exploration=0.0", False, None),
    "grad_norm-ema_decay": (lambda: GradNormPolicy(layers_per_step=2, ema_decay=0.5),
                            lambda: GradNormPolicy(layers_per_step=2),
                            r"saved with ema_decay=0.5 continues under ema_decay=0.9", False, None),
    "grad_norm-three-at-once": (lambda: GradNormPolicy(layers_per_step=2, ema_decay=0.5, max_staleness=3),
                                lambda: GradNormPolicy(layers_per_step=2, exploration=0.0),
                                r"saved with ema_decay=0.5, exploration=0.1, max_staleness=3 continues under "
                                r"ema_decay=0.9, exploration=0.0, max_staleness=8", False, None),  # 2 * ceil(8 / 2)
    "grad_norm-seed": (lambda: GradNormPolicy(layers_per_step=2), lambda: GradNormPolicy(layers_per_step=2, seed=1),
                       None, True, None),  # it draws no random number
    "cyclic-seed": (lambda: CyclicPolicy(layers_per_step=2), lambda: CyclicPolicy(layers_per_step=2, seed=1),
                    None, True, None),
    "full-of-0.7": (lambda: FullPolicy(), lambda: FullPolicy(), None, True, None),
    "top_only-of-0.7": (lambda: TopOnlyPolicy(layers_per_step=2), lambda: TopOnlyPolicy(layers_per_step=2),
                        None, True, None),
    "full-switch_every": (lambda: FullPolicy(switch_every=4), lambda: FullPolicy(), None, True, None),
    # a round of 4 steps: the saved round 5 would be "back in time" at step 6; the round is chosen anew
    "full-switch_every-longer": (lambda: FullPolicy(), lambda: FullPolicy(switch_every=4), None, True, None),
    "top_only-switch_every-longer": (lambda: TopOnlyPolicy(layers_per_step=2),
                                     lambda: TopOnlyPolicy(layers_per_step=2, switch_every=4), None, True, None),
    "top_only-k": (lambda: TopOnlyPolicy(layers_per_step=2), lambda: TopOnlyPolicy(layers_per_step=3),
                   r"saved with k=2 continues under k=3", False, None),
    "dyadic-of-0.7": (lambda: DyadicPolicy(levels=4), lambda: DyadicPolicy(levels=4),
                      r"does not record switch_every, levels .*this policy's switch_every=1, levels=4", True, None),
    # what the saved state means depends on these: refused, naming the argument that resumes it
    "dyadic-levels": (lambda: DyadicPolicy(levels=4), lambda: DyadicPolicy(), None, False,
                      r"the checkpoint has levels=4, this policy has levels=3.*build the policy with `levels=4`"),
    "dyadic-switch_every": (lambda: DyadicPolicy(switch_every=2), lambda: DyadicPolicy(), None, False,
                            r"has switch_every=2, this policy has switch_every=1.*with `switch_every=2`"),
    "cyclic-k": (lambda: CyclicPolicy(layers_per_step=2), lambda: CyclicPolicy(fraction=0.5), None, False,
                 r"has k=2, this policy has k=4.*`layers_per_step=2`"),
    "random-k": (lambda: RandomPolicy(layers_per_step=2), lambda: RandomPolicy(layers_per_step=3), None, False,
                 r"has k=2, this policy has k=3.*`layers_per_step=2`"),
    "grad_norm-switch_every": (lambda: GradNormPolicy(layers_per_step=2, switch_every=3),
                               lambda: GradNormPolicy(layers_per_step=2), None, False,
                               r"has switch_every=3, this policy has switch_every=1.*`switch_every=3`"),
    "cyclic-num_blocks": (lambda: CyclicPolicy(layers_per_step=2), lambda: CyclicPolicy(layers_per_step=2), None, False,
                          r"has num_blocks=8, this policy has num_blocks=6.*the model it was saved from \(8 blocks\)"),
}


@pytest.mark.parametrize("case", RESUMES)
def test_a_resume_is_refused_only_where_the_saved_state_means_something_else(case: str) -> None:
    """Every saved run steps to 5 and resumes in a policy built otherwise: it continues with at most one warning (the
    old and the new values), or it is refused, naming the argument that resumes it."""
    saved_factory, resumed_factory, warning, same, refused = RESUMES[case]
    saved, resumed = saved_factory(), resumed_factory()
    saved.setup(8)
    resumed.setup(6 if case.endswith("num_blocks") else 8)
    for t in range(6):
        saved.observe({i: float(i * t % 5 + 1) for i in saved.select(t)})
    state = _of_0_7(saved.state_dict()) if case.endswith("of-0.7") else saved.state_dict()
    if refused:
        with pytest.raises(ValueError, match=refused):
            resumed.load_state_dict(state)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
    messages = [str(w.message) for w in caught]
    assert len(messages) == (warning is not None), messages
    if warning is not None:
        assert re.search(warning, messages[0]), messages[0]
    continued = [resumed.select(t) for t in range(6, 20)]
    assert all(len(s) == resumed.k for s in continued) or isinstance(resumed, DyadicPolicy)
    if same:
        assert continued == [saved.select(t) for t in range(6, 20)]


def test_lcsb_callback_resumes_a_run_of_another_seed(residual_net) -> None:
    """``LCSBCallback("random", seed=1)`` resuming a ``seed=0`` run (a recipe resumed under another global seed):
    one warning, and the blocks the seed-0 run would have trained."""
    from lcsb_lightning import LCSBCallback, LCSBController

    def controller(seed: int) -> LCSBController:
        return LCSBController(residual_net(num_blocks=6), LCSBCallback("random", layers_per_step=2, seed=seed).policy)

    first, reference, resumed = controller(0), controller(0), controller(1)
    for t in range(5):
        first.begin_step(t)
        reference.begin_step(t)
    with pytest.warns(UserWarning, match="saved with seed=0 continues under seed=1") as record:
        resumed.load_state_dict(first.state_dict())
    assert len(record) == 1
    assert [resumed.begin_step(t) for t in range(5, 15)] == [reference.begin_step(t) for t in range(5, 15)]


def test_full_and_top_only() -> None:
    full = FullPolicy()
    full.setup(5)
    assert full.select(0) == (0, 1, 2, 3, 4)
    top_only = TopOnlyPolicy(layers_per_step=2)
    top_only.setup(5)
    assert {top_only.select(t) for t in range(10)} == {(3, 4)}


def _assert_dyadic_depths(depths: list[int], **kwargs: object) -> None:
    """A DyadicPolicy over 8 blocks selects ``depths`` blocks per step, and a resumed copy continues alike."""
    policy = build_policy("dyadic", **kwargs)
    policy.setup(num_blocks=8)
    assert [len(policy.select(t)) for t in range(len(depths))] == depths
    resumed = build_policy("dyadic", **kwargs)
    resumed.setup(num_blocks=8)
    resumed.load_state_dict(policy.state_dict())
    assert resumed.select(len(depths)) == policy.select(len(depths))


@pytest.mark.parametrize(("levels", "switch_every", "depths"), [
    (3, 1, [8, 2, 4, 2, 8, 2, 4, 2, 8, 2]),
    (4, 1, [8, 1, 2, 1, 4, 1, 2, 1, 8, 1, 2, 1]),
    (3, 2, [8, 8, 2, 2, 4, 4, 2, 2, 8, 8, 2, 2]),
])
def test_dyadic_levels(levels: int, switch_every: int, depths: list[int]) -> None:
    _assert_dyadic_depths(depths, levels=levels, switch_every=switch_every)


def test_registry_lists_every_policy() -> None:
    assert available_policies() == ["cyclic", "dyadic", "full", "grad_norm", "random", "top_only"]


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: build_policy("lisa", layers_per_step=1), "Unknown policy 'lisa'; available: cyclic, dyadic, full, grad_norm, random, top_only"),
        (lambda: CyclicPolicy(), "needs `layers_per_step=k` or `fraction=f`; got neither"),
        (lambda: CyclicPolicy(layers_per_step=2, fraction=0.5), "Give only one of `layers_per_step` \\(2\\) and `fraction` \\(0.5\\)"),
        (lambda: CyclicPolicy(layers_per_step=0), "`layers_per_step` must be an integer >= 1, got 0"),
        (lambda: CyclicPolicy(fraction=1.5), "`fraction` must be in \\(0, 1\\], got 1.5"),
        (lambda: CyclicPolicy(fraction=0.0), "`fraction` must be in \\(0, 1\\], got 0.0"),
        (lambda: CyclicPolicy(layers_per_step=1, switch_every=0), "`switch_every` must be an integer >= 1"),
        (lambda: GradNormPolicy(layers_per_step=1, ema_decay=1.0), "`ema_decay` must be in \\[0, 1\\)"),
        (lambda: CyclicPolicy(layers_per_step=9).setup(8), "`layers_per_step=9` exceeds the model's 8 blocks; allowed: 1..8"),
        (lambda: build_policy("dyadic", levels=0), r"`levels` must be an integer >= 1, got 0\.$"),
        (lambda: build_policy("dyadic", levels={0: 4, 24: 3}), r"`levels` must be an integer >= 1, got \{0: 4, 24: 3\}\.$"),
        # a size given to a policy that takes none is refused, not ignored
        (lambda: build_policy("dyadic", layers_per_step=4),
         r"`layers_per_step=4` sizes the policies cyclic, grad_norm, random, top_only; 'dyadic' takes none\.$"),
        (lambda: build_policy("full", fraction=0.5), r"`fraction=0.5` sizes the policies .*; 'full' takes none\.$"),
        (lambda: DyadicPolicy(layers_per_step=4), r"DyadicPolicy takes no size: `layers_per_step=4`"),
        (lambda: FullPolicy(fraction=0.5), r"FullPolicy takes no size: `fraction=0.5`"),
    ],
)
def test_policy_errors(factory, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()


def test_select_before_setup_and_backwards_fail() -> None:
    policy = CyclicPolicy(layers_per_step=1)
    with pytest.raises(RuntimeError, match="setup\\(num_blocks\\) must be called"):
        policy.select(0)
    policy.setup(3)
    policy.select(5)
    with pytest.raises(ValueError, match="went back in time"):
        policy.select(2)


@pytest.mark.parametrize(
    ("factory", "num_blocks", "cycle"),
    [
        (lambda: DyadicPolicy(), 30, 4),
        (lambda: DyadicPolicy(levels=4), 30, 8),
        (lambda: DyadicPolicy(levels=3), 30, 4),
        (lambda: DyadicPolicy(levels=3, switch_every=2), 30, 8),
        (lambda: DyadicPolicy(levels=5), 16, 16),
        (lambda: FullPolicy(), 6, 1),
        (lambda: TopOnlyPolicy(layers_per_step=2), 6, 1),
        (lambda: CyclicPolicy(layers_per_step=2), 6, 3),
        (lambda: CyclicPolicy(layers_per_step=2, switch_every=3), 5, 9),
    ],
)
def test_cycle_steps_is_the_period_of_the_selections(factory, num_blocks: int, cycle: int) -> None:
    policy = factory()
    policy.setup(num_blocks)
    assert policy.cycle_steps == cycle
    selections = [policy.select(t) for t in range(3 * cycle)]
    assert selections[:cycle] == selections[cycle:2 * cycle] == selections[2 * cycle:]


def test_cycle_steps_unknown_without_a_fixed_cycle_or_before_setup() -> None:
    assert RandomPolicy(layers_per_step=2).cycle_steps is None
    assert CyclicPolicy(layers_per_step=2).cycle_steps is None  # its number of groups needs the model's blocks
    assert DyadicPolicy(levels=4).cycle_steps == 8              # known from its levels alone


def test_the_default_is_the_three_level_ruler() -> None:
    """0.6.0: 3 levels (depths N/4, N/2, N) measured best on time to quality (docs/results.md, "The default")."""
    from lcsb_lightning import LCSBCallback

    policy = LCSBCallback().policy
    policy.setup(num_blocks=8)
    assert isinstance(policy, DyadicPolicy) and policy.levels == 3
    assert [len(policy.select(t)) for t in range(4)] == [8, 2, 4, 2]
    assert DyadicPolicy().levels == 3


@pytest.mark.parametrize(("num_blocks", "size", "max_staleness", "rebinds"), [
    (12, {"layers_per_step": 3}, None, {10: 8, 30: 4}),
    (16, {"fraction": 0.1}, None, {14: 14, 42: 7}),  # k from 2 to 1: the bound grows
    (30, {"fraction": 0.25}, None, {20: 15, 60: 8}),  # the recipe's freeze=progressive
    (19, {"layers_per_step": 6}, 1, {2: 18}),  # in the first cycle, with overdue blocks waiting
])
def test_grad_norms_staleness_bound_holds_across_rebinds(num_blocks: int, size: dict[str, Any],
                                                         max_staleness: int | None, rebinds: dict[int, int]) -> None:
    """Adversarial norms (blocks 5, 9, 10 and 12 of the model loud), the lowest blocks dropped at the given rounds: a
    gap between two trainings of a block is at most the largest bound in force during it."""
    policy = GradNormPolicy(**size, max_staleness=max_staleness)
    policy.setup(num_blocks)
    first, last, bounds = 0, {b: -1 for b in range(num_blocks)}, []
    for t in range(120):
        if t in rebinds:
            policy.rebind(rebinds[t])
            first = num_blocks - rebinds[t]
        bounds.append(policy.staleness_bound)
        selected = [first + i for i in policy.select(t)]
        for b in selected:
            assert t - last[b] <= max(bounds[max(last[b], 0):]), (b, last[b], t)
            last[b] = t
        policy.observe({b - first: 100.0 if b in (5, 9, 10, 12) else 0.01 for b in selected})
    assert all(120 - last[b] <= max(bounds[last[b]:]) for b in range(first, num_blocks))  # the gaps still open
