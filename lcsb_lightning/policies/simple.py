"""Deterministic policies: cyclic (the paper's), dyadic (the default), full backprop, and top-only."""

from __future__ import annotations

from typing import Any

from lcsb_lightning.policies.base import SelectionPolicy, balanced_groups, register_policy
from lcsb_lightning.validation import check_int


@register_policy("cyclic")
class CyclicPolicy(SelectionPolicy):
    """Layer-cyclic selection: round ``r`` trains group ``r mod G`` of ``G = ceil(N / k)`` consecutive groups of
    near-equal size, so every block trains once per cycle of ``G`` rounds.

    Example::

        >>> policy = CyclicPolicy(layers_per_step=2)
        >>> policy.setup(num_blocks=6)
        >>> [policy.select(t) for t in range(4)]
        [(0, 1), (2, 3), (4, 5), (0, 1)]
    """

    def _on_setup(self) -> None:
        self.groups = balanced_groups(list(range(self.num_blocks)), self.num_groups)

    @property
    def cycle_steps(self) -> int | None:
        return self.num_groups * self.switch_every if self.num_blocks else None

    def _choose(self, round_index: int) -> list[int]:
        return self.groups[round_index % len(self.groups)]


@register_policy("full")
class FullPolicy(SelectionPolicy):
    """Every block, every step: the full-backprop baseline through the same code path."""

    needs_size = False
    cycle_steps = 1
    state_args = ()  # k is the model's number of blocks, and the round is not needed

    def _choose(self, round_index: int) -> list[int]:
        return list(range(self.num_blocks))


@register_policy("top_only")
class TopOnlyPolicy(SelectionPolicy):
    """Only the top ``k`` blocks ever train; the rest never do (the LCSB paper's "Freeze" baseline)."""

    cycle_steps = 1
    state_args = ()  # the round is not needed, and nothing saved depends on k: the top k of this policy train on
    changeable_args = ("k",)

    def _choose(self, round_index: int) -> list[int]:
        return list(range(self.num_blocks - self.k, self.num_blocks))


@register_policy("dyadic")
class DyadicPolicy(SelectionPolicy):
    """Top-down selection whose depth doubles on a ruler schedule: round ``r`` trains the top ``N / 2^(L-1-v)``
    blocks, ``v`` the times 2 divides ``r`` (capped at ``L - 1``; round 0 trains all). The expected depth is
    ``N * (1 / 2^(L-1) + (L - 1) / 2^L)`` (``N/2`` for ``L = 3``), and every gradient is exact.

    Args:
        levels: ``L``, the number of depths (3, the default: N/4, N/2 and N, reached 90% of full backprop's
            improvement sooner than 4 in every measured pipeline: docs/results.md).

    Example::

        >>> policy = DyadicPolicy(levels=3)
        >>> policy.setup(num_blocks=8)
        >>> [len(policy.select(t)) for t in range(8)]
        [8, 2, 4, 2, 8, 2, 4, 2]
    """

    needs_size = False
    state_args = ("switch_every", "levels")  # k is the model's number of blocks

    def __init__(self, *args: Any, levels: int = 3, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.levels = check_int("levels", levels, 1)

    @property
    def cycle_steps(self) -> int:
        """The ruler's period."""
        return 2 ** (self.levels - 1) * self.switch_every

    def __repr__(self) -> str:
        depths = f", depths={[len(self._choose(r)) for r in range(2 ** (self.levels - 1))]}" if self.num_blocks else ""
        return f"DyadicPolicy(levels={self.levels}{depths}, switch_every={self.switch_every})"

    def _choose(self, round_index: int) -> list[int]:
        position = round_index % 2 ** (self.levels - 1)
        halvings = (position & -position).bit_length() - 1 if position else self.levels - 1
        depth = max(1, round(self.num_blocks / 2 ** (self.levels - 1 - halvings)))
        return list(range(self.num_blocks - depth, self.num_blocks))

