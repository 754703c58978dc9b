"""Deterministic policies: cyclic (the paper's), full backprop, and the Freeze baseline."""

from __future__ import annotations

from collections.abc import Mapping
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

    def _choose(self, round_index: int) -> list[int]:
        return list(range(self.num_blocks))


@register_policy("freeze")
class FreezePolicy(SelectionPolicy):
    """Only the top ``k`` blocks ever train (the paper's Freeze baseline); the rest stay frozen."""

    cycle_steps = 1

    def _choose(self, round_index: int) -> list[int]:
        return list(range(self.num_blocks - self.k, self.num_blocks))


@register_policy("dyadic")
class DyadicPolicy(SelectionPolicy):
    """Top-down selection whose depth doubles on a ruler schedule: the top ``N / 2^(L-1)`` blocks every
    round, twice as many every second round, ..., all ``N`` blocks every ``2^(L-1)``-th round.

    Round ``r`` trains the top ``N / 2^(L-1-v)`` blocks, where ``v`` is the number of times 2 divides
    ``r`` (capped at ``L - 1``; round 0 trains all). A block in the top ``N / 2^(L-1)`` trains every
    round; one in the bottom half every ``2^(L-1)``-th. The expected depth is
    ``N * (1 / 2^(L-1) + (L - 1) / 2^L)`` (``5N/16`` for ``L = 4``), so with ``backward="selected_only"`` the
    backward pass costs about a third of full backprop's and every gradient is exact.

    Args:
        levels: ``L``, the number of depths (``L = 4``: N/8, N/4, N/2 and N), or a schedule
            ``{first_step: L, ...}`` that changes it during the run (it must start at step 0):
            ``{0: 5, 10: 4, 25: 3}`` runs 5 levels for steps 0-9, 4 for 10-24 and 3 from step 25 on,
            a backward that deepens as the loss curve flattens.
        full_after: From this optimizer step on, every block trains (full backprop); ``None``: never.
            The cheap shallow steps make the early, fast part of the loss curve sooner, full steps the
            slow, late part, where a shallow step learns too little for its cost. With ``switch_every > 1``:
            from the first round that starts at or after it.

    Example::

        >>> policy = DyadicPolicy(levels=3)
        >>> policy.setup(num_blocks=8)
        >>> [len(policy.select(t)) for t in range(8)]
        [8, 2, 4, 2, 8, 2, 4, 2]
        >>> policy = DyadicPolicy(levels=3, full_after=5)
        >>> policy.setup(num_blocks=8)
        >>> [len(policy.select(t)) for t in range(8)]
        [8, 2, 4, 2, 8, 8, 8, 8]
        >>> policy = DyadicPolicy(levels={0: 3, 4: 2})
        >>> policy.setup(num_blocks=8)
        >>> [len(policy.select(t)) for t in range(8)]
        [8, 2, 4, 2, 8, 4, 8, 4]
    """

    needs_size = False

    def __init__(
        self, *args: Any, levels: int | Mapping[int, int] = 4, full_after: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        #: ``(first step, levels)`` pairs in step order, the first at step 0
        self.levels_from = _levels_schedule(levels)
        if full_after is not None and not _is_whole(full_after, 0):
            raise ValueError(f"`full_after` must be None or an optimizer step >= 0, got {full_after!r}.")
        self.full_after = None if full_after is None else int(full_after)

    @property
    def levels(self) -> int | dict[int, int]:
        """The number of levels, or its schedule ``{first_step: levels}`` when it changes during the run."""
        return self.levels_from[0][1] if len(self.levels_from) == 1 else dict(self.levels_from)

    @property
    def cycle_steps(self) -> int:
        """The longest ruler's period (every window of a multiple of it, within one entry of the schedule, holds
        each depth in its share)."""
        return max(2 ** (levels - 1) for _, levels in self.levels_from) * self.switch_every

    def __repr__(self) -> str:
        levels = self.levels
        depths = (f", depths={[len(self._ruler(r, levels)) for r in range(2 ** (levels - 1))]}"
                  if isinstance(levels, int) and self.num_blocks else "")
        then = f", full_after={self.full_after}" if self.full_after is not None else ""
        return f"DyadicPolicy(levels={levels}{depths}{then}, switch_every={self.switch_every})"

    def _choose(self, round_index: int) -> list[int]:
        step = round_index * self.switch_every
        if self.full_after is not None and step >= self.full_after:
            return list(range(self.num_blocks))
        levels = next(count for first, count in reversed(self.levels_from) if first <= step)
        return self._ruler(round_index, levels)

    def _ruler(self, round_index: int, levels: int) -> list[int]:
        period = 2 ** (levels - 1)
        position = round_index % period
        halvings = (position & -position).bit_length() - 1 if position else levels - 1
        depth = max(1, round(self.num_blocks / 2 ** (levels - 1 - halvings)))
        return list(range(self.num_blocks - depth, self.num_blocks))


def _is_whole(value: Any, least: int) -> bool:
    """``value`` is an integer (``4`` or ``4.0``, not ``True``) and at least ``least``."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and int(value) == value and value >= least


def _levels_schedule(levels: int | Mapping[int, int]) -> list[tuple[int, int]]:
    """``levels`` as ``(first step, levels)`` pairs in step order; raises on a value that is not one."""
    if not isinstance(levels, Mapping):
        if not _is_whole(levels, 1):
            raise ValueError(f"`levels` must be an integer >= 1 or a schedule {{first_step: levels}}, got {levels!r}.")
        return [(0, int(levels))]
    schedule = sorted(levels.items())
    if not schedule or schedule[0][0] != 0 or not all(_is_whole(s, 0) and _is_whole(c, 1) for s, c in schedule):
        raise ValueError(
            f"`levels` as a schedule must map optimizer steps >= 0, the first of them 0, to integers >= 1 "
            f"(e.g. {{0: 5, 10: 4, 25: 3}}), got {dict(levels)!r}."
        )
    return [(int(step), int(count)) for step, count in schedule]
