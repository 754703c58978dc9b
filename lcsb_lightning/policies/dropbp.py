"""DropBP's sublayer drop (Woo et al., arXiv 2402.17812) as a selection policy over attention and MLP units."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import torch

from lcsb_lightning.policies.base import SelectionPolicy, register_policy

ALLOCATIONS = ("uniform", "sensitivity")
#: DropBP's allocation raises drop rates in steps of 0.1 up to 0.9 (dropbp/cpp_extention/allocate_p.cc).
RATE_STEP, MAX_RATE = 0.1, 0.9


def allocate_drop_rates(
    sensitivity: Sequence[float], flops: Sequence[float], drop_rate: float,
    rate_step: float = RATE_STEP, max_rate: float = MAX_RATE,
) -> list[float]:
    """DropBP's greedy allocation: starting from 0, raise by ``rate_step`` the rate of the unit with the smallest
    ``sensitivity * (rate + rate_step)`` (the marginal cost of ``sum(sensitivity * rate^2)``), at most to
    ``max_rate``, until the kept backward FLOPs ``sum(flops * (1 - rate))`` are at most ``(1 - drop_rate)`` of all.

    Raises:
        ValueError: if the lists differ in length or ``drop_rate`` cannot be met with rates <= ``max_rate``.

    Example::

        >>> allocate_drop_rates([1.0, 4.0], [1.0, 1.0], drop_rate=0.5)  # the less sensitive unit drops more
        [0.8, 0.2]
    """
    if len(sensitivity) != len(flops):
        raise ValueError(f"{len(sensitivity)} sensitivities for {len(flops)} FLOP counts.")
    if drop_rate > max_rate + 1e-9:
        raise ValueError(f"`drop_rate={drop_rate}` cannot be met: each unit's rate is at most {max_rate}.")
    rates = [0.0] * len(flops)
    kept, budget = float(sum(flops)), (1.0 - drop_rate) * float(sum(flops))
    heap = [(float(s) * rate_step, i) for i, s in enumerate(sensitivity)]
    heapq.heapify(heap)
    while kept > budget * (1 + 1e-9) and heap:
        _, i = heapq.heappop(heap)
        rates[i] = round(rates[i] + rate_step, 10)
        kept -= float(flops[i]) * rate_step
        if rates[i] + rate_step <= max_rate + 1e-9:
            heapq.heappush(heap, (float(sensitivity[i]) * (rates[i] + rate_step), i))
    return rates


@register_policy("dropbp")
class DropBPPolicy(SelectionPolicy):
    """Drops each attention and MLP sublayer from the backward independently (DropBP).

    The units are a model's sublayers, ``2 * block`` its attention and ``2 * block + 1`` its MLP; a dropped one
    passes the gradient through the residual only (:mod:`lcsb_lightning.sublayers`). Each step every unit drops
    with its own probability; when fewer than ``drop_rate`` of the units drop, the ones with the highest rates
    (ties in random order) drop too, as DropBP does, so a step never keeps more than ``1 - drop_rate`` of them.

    Two differences from the authors' code: one draw holds for a whole optimizer step (DropBP draws at every
    micro-batch; they differ under gradient accumulation), and with several processes each measures the
    sensitivity on its own example and the callback averages them (DropBP measures one process's gradients).

    Args:
        drop_rate: the target share of the backward to drop, in [0, 1) (DropBP's default: 0.5).
        allocation: ``"uniform"``: every unit drops with ``drop_rate``. ``"sensitivity"``: after
            ``sensitivity_at`` of the training steps, the callback measures each unit's sensitivity on one
            example (one forward and backward per unit) and the rates are allocated by
            :func:`allocate_drop_rates` under the FLOP budget ``drop_rate`` (``drop_rate <= 0.9``).
        sensitivity_at: the share of the run's optimizer steps after which the sensitivity is measured
            (DropBP: 0.1); uniform rates until then.
        switch_every: optimizer steps between draws.
        seed: seed of the draws.

    Example::

        >>> policy = DropBPPolicy(drop_rate=0.5, seed=0)
        >>> policy.setup(num_blocks=8)  # 4 blocks, 8 sublayers
        >>> len(policy.select(0)) <= 4
        True
    """

    needs_size = False
    granularity = "sublayer"

    def __init__(
        self, drop_rate: float = 0.5, allocation: str = "uniform", sensitivity_at: float = 0.1,
        switch_every: int = 1, seed: int = 0,
    ) -> None:
        super().__init__(switch_every=switch_every, seed=seed)
        if not 0.0 <= float(drop_rate) < 1.0:
            raise ValueError(f"`drop_rate` must be in [0, 1), got {drop_rate!r}.")
        if allocation not in ALLOCATIONS:
            raise ValueError(f"`allocation={allocation!r}` is not supported; allowed: {', '.join(ALLOCATIONS)}.")
        if allocation == "sensitivity" and float(drop_rate) > MAX_RATE:
            raise ValueError(f"`drop_rate={drop_rate}` with allocation='sensitivity' must be <= {MAX_RATE}.")
        if not 0.0 <= float(sensitivity_at) < 1.0:
            raise ValueError(f"`sensitivity_at` must be in [0, 1), got {sensitivity_at!r}.")
        self.drop_rate, self.allocation, self.sensitivity_at = float(drop_rate), allocation, float(sensitivity_at)
        self.rates: list[float] = []
        self.allocated = False

    def _on_setup(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)
        self.rates = [self.drop_rate] * self.num_blocks
        self.allocated = False

    @property
    def needs_sensitivity(self) -> bool:
        """Whether the rates still wait for :meth:`allocate`."""
        return self.allocation == "sensitivity" and not self.allocated

    def sensitivity_step(self, total_steps: int) -> int:
        """The optimizer step after which the sensitivity is measured in a run of ``total_steps``."""
        return max(1, int(self.sensitivity_at * total_steps))

    def allocate(self, sensitivity: Sequence[float], flops: Sequence[float]) -> list[float]:
        """Set the rates from the units' measured ``sensitivity`` and forward ``flops`` (DropBP's allocation)."""
        if len(sensitivity) != self.num_blocks:
            raise ValueError(f"{len(sensitivity)} sensitivities for {self.num_blocks} units.")
        self.rates = allocate_drop_rates(sensitivity, flops, self.drop_rate)
        self.allocated = True
        return list(self.rates)

    def _choose(self, round_index: int) -> list[int]:
        draws = torch.rand(self.num_blocks, generator=self.generator).tolist()
        dropped = {i for i, (u, rate) in enumerate(zip(draws, self.rates)) if u < rate}
        at_least = math.ceil(self.drop_rate * self.num_blocks - 1e-9)
        if len(dropped) < at_least:
            tie_break = torch.randperm(self.num_blocks, generator=self.generator).tolist()
            order = sorted(range(self.num_blocks), key=lambda i: (-self.rates[i], tie_break[i]))
            dropped.update([i for i in order if i not in dropped][: at_least - len(dropped)])
        return [i for i in range(self.num_blocks) if i not in dropped]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "generator": self.generator.get_state(), "rates": list(self.rates),
                "allocated": self.allocated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.generator.set_state(state["generator"])
        self.rates, self.allocated = [float(r) for r in state["rates"]], bool(state["allocated"])

    def __repr__(self) -> str:
        return f"DropBPPolicy(drop_rate={self.drop_rate}, allocation={self.allocation!r})"
