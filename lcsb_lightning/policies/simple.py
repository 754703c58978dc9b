"""Deterministic policies: cyclic (the paper's), full backprop, and the Freeze baseline."""

from __future__ import annotations

from typing import Any

from lcsb_lightning.policies.base import SelectionPolicy, balanced_groups, register_policy


@register_policy("cyclic")
class CyclicPolicy(SelectionPolicy):
    """Layer-cyclic selection: the blocks split into consecutive groups of (at most) ``k``.

    With ``G = ceil(N / k)`` groups of near-equal size, step ``t`` trains group
    ``(t // switch_every) mod G``, so every block trains exactly once per cycle of ``G`` rounds.

    Example::

        >>> policy = CyclicPolicy(layers_per_step=2)
        >>> policy.setup(num_blocks=6)
        >>> [policy.select(t) for t in range(4)]
        [(0, 1), (2, 3), (4, 5), (0, 1)]
    """

    def __init__(self, *args: Any, descending: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.descending = bool(descending)

    def _on_setup(self) -> None:
        self.groups = balanced_groups(list(range(self.num_blocks)), self.num_groups)
        if self.descending:
            self.groups.reverse()

    def _choose(self, round_index: int) -> list[int]:
        return self.groups[round_index % len(self.groups)]


@register_policy("full")
class FullPolicy(SelectionPolicy):
    """Every block, every step: the full-backprop baseline through the same code path."""

    needs_size = False

    def _choose(self, round_index: int) -> list[int]:
        return list(range(self.num_blocks))


@register_policy("freeze")
class FreezePolicy(SelectionPolicy):
    """Only the top ``k`` blocks ever train (the paper's Freeze baseline); the rest stay frozen."""

    def _choose(self, round_index: int) -> list[int]:
        return list(range(self.num_blocks - self.k, self.num_blocks))
