"""Adaptive and random policies: random (LISA / BAdam-random) and gradient-norm importance."""

from __future__ import annotations

import math
from typing import Any, TypeVar

import torch

from lcsb_lightning.policies.base import SelectionPolicy, balanced_groups, register_policy
from lcsb_lightning.validation import check_int


@register_policy("random")
class RandomPolicy(SelectionPolicy):
    """``k`` distinct random blocks per round from a seeded ``torch.Generator``.

    Args:
        reshuffle: ``True`` draws a fresh permutation per cycle and walks it in groups, so every block
            trains once per cycle of ``ceil(N / k)`` rounds (BAdam's random order). ``False`` samples
            ``k`` blocks independently every round (LISA).

    Example::

        >>> policy = RandomPolicy(layers_per_step=2, seed=0)
        >>> policy.setup(num_blocks=4)
        >>> sorted(set(policy.select(0)) | set(policy.select(1)))
        [0, 1, 2, 3]
    """

    # the saved generator state decides what follows, not the seed that made it
    changeable_args = ("seed", "reshuffle")

    def __init__(self, *args: Any, reshuffle: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reshuffle = bool(reshuffle)

    def _on_setup(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)
        self._cycle: list[list[int]] = []

    def _on_rebind(self, dropped: int) -> None:
        self._cycle = []  # a permutation of the blocks bound before; the generator goes on

    def _choose(self, round_index: int) -> list[int]:
        if not self.reshuffle:
            return torch.randperm(self.num_blocks, generator=self.generator)[: self.k].tolist()
        position = round_index % self.num_groups
        if position == 0 or not self._cycle:
            permutation = torch.randperm(self.num_blocks, generator=self.generator).tolist()
            self._cycle = balanced_groups(permutation, self.num_groups)
        return self._cycle[position]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "generator": self.generator.get_state(), "cycle": self._cycle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.generator.set_state(state["generator"])
        self._cycle = [list(group) for group in state["cycle"]]


@register_policy("grad_norm")
class GradNormPolicy(SelectionPolicy):
    """Importance selection from an EMA of each block's LoRA gradient norm, with bounded staleness.

    The first cycle walks the unmeasured blocks in consecutive groups (unless one is overdue). After that a round
    trains the *overdue* blocks (untrained for ``max_staleness`` rounds or more, oldest first), then the
    highest-scoring others, ``score = ema / max(ema) + exploration * staleness / G`` with ``G = ceil(N / k)``.
    An overdue block has at most ``N - 1`` ahead of it and ``k`` are served per round, so no block goes more than
    :attr:`staleness_bound` ``= max_staleness + G - 1`` rounds untrained (across a :meth:`rebind`: the larger bound).

    Args:
        ema_decay: weight of the previous EMA value, in [0, 1).
        exploration: weight of the staleness bonus, >= 0.
        max_staleness: rounds after which a block is forced in; default ``2 * G``.
    """

    changeable_args = ("ema_decay", "exploration", "max_staleness")

    def __init__(self, *args: Any, ema_decay: float = 0.9, exploration: float = 0.1, max_staleness: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"`ema_decay` must be in [0, 1), got {ema_decay!r}.")
        if exploration < 0:
            raise ValueError(f"`exploration` must be >= 0, got {exploration!r}.")
        self.ema_decay, self.exploration = float(ema_decay), float(exploration)
        self._max_staleness = None if max_staleness is None else check_int("max_staleness", max_staleness, 1)

    @property
    def max_staleness(self) -> int:
        return self._max_staleness if self._max_staleness is not None else 2 * self.num_groups

    @property
    def staleness_bound(self) -> int:
        """Most rounds a block can go between two trainings."""
        return self.max_staleness + self.num_groups - 1

    def _on_setup(self) -> None:
        self.ema: list[float | None] = [None] * self.num_blocks
        self.last_trained: list[int] = [-1] * self.num_blocks

    def _on_rebind(self, dropped: int) -> None:
        self.ema = _shifted(self.ema, dropped, None)
        self.last_trained = _shifted(self.last_trained, dropped, -1)

    def _choose(self, round_index: int) -> list[int]:
        staleness = [round_index - last for last in self.last_trained]
        overdue = sorted((i for i in range(self.num_blocks) if staleness[i] >= self.max_staleness),
                         key=lambda i: (-staleness[i], i))  # never trained: the oldest
        unmeasured = [i for i, last in enumerate(self.last_trained) if last < 0]
        if unmeasured and not overdue:  # the first cycle's consecutive groups (the first of those still needed)
            chosen = balanced_groups(unmeasured, math.ceil(len(unmeasured) / self.k))[0]
        else:
            chosen = overdue[: self.k]
            seen = [e for e in self.ema if e is not None]
            top = max(seen) if seen and max(seen) > 0 else 1.0
            scores = {
                i: (self.ema[i] or 0.0) / top + self.exploration * staleness[i] / self.num_groups
                for i in range(self.num_blocks)
                if i not in chosen
            }
            chosen += sorted(scores, key=lambda i: (-scores[i], i))[: self.k - len(chosen)]
        for i in chosen:
            self.last_trained[i] = round_index
        return chosen

    def observe(self, grad_norms: dict[int, float]) -> None:
        for block, norm in grad_norms.items():
            previous = self.ema[block]
            self.ema[block] = norm if previous is None else self.ema_decay * previous + (1 - self.ema_decay) * norm

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ema": list(self.ema), "last_trained": list(self.last_trained)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ema = list(state["ema"])
        self.last_trained = list(state["last_trained"])


T = TypeVar("T")


def _shifted(per_block: list[T], dropped: int, fill: T) -> list[T]:
    """``per_block`` after the lowest ``dropped`` blocks left (negative: as many came in below, at ``fill``)."""
    return per_block[dropped:] if dropped >= 0 else [fill] * -dropped + per_block
