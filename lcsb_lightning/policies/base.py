"""The selection-policy interface, subset sizing and the name registry."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Callable, TypeVar

from lcsb_lightning.rank_zero import rank_zero_warn
from lcsb_lightning.validation import check_int

Selection = tuple[int, ...]


def balanced_groups(indices: list[int], num_groups: int) -> list[list[int]]:
    """Split ``indices`` into ``num_groups`` consecutive groups whose sizes differ by at most one."""
    base, extra = divmod(len(indices), num_groups)
    starts = [g * base + min(g, extra) for g in range(num_groups + 1)]  # the first `extra` groups hold one more
    return [indices[start:end] for start, end in zip(starts, starts[1:])]


class SelectionPolicy(ABC):
    """Chooses which blocks are back-propagated at each optimizer step.

    Bound to a model's block count by :meth:`setup`; ``select(step)`` is called with increasing steps and chooses a
    new subset every ``switch_every`` steps (one "round").

    Args:
        layers_per_step: ``k``, the number of blocks trained per round.
        fraction: ``f`` in (0, 1]; ``k = max(1, round(f * N))``. Give exactly one of ``k`` and ``f`` (unless
            ``needs_size = False``).
        switch_every: optimizer steps between re-selections.
        seed: seed of the policy's random generator (if any).
    """

    #: Whether the policy needs exactly one of ``layers_per_step`` / ``fraction``.
    needs_size: bool = True
    #: Attributes the saved state's meaning depends on (besides ``num_blocks``): other values refuse a checkpoint.
    state_args: tuple[str, ...] = ("k", "switch_every")
    #: Recorded arguments nothing saved depends on: other values continue a checkpoint, with one warning.
    changeable_args: tuple[str, ...] = ()

    def __init__(self, layers_per_step: int | None = None, fraction: float | None = None, switch_every: int = 1,
                 seed: int = 0) -> None:
        sizes = _given_sizes(layers_per_step, fraction)
        if sizes and not self.needs_size:
            name, value = next(iter(sizes.items()))
            raise ValueError(f"{type(self).__name__} takes no size: `{name}={value!r}`.")
        if layers_per_step is not None and fraction is not None:
            raise ValueError(f"Give only one of `layers_per_step` ({layers_per_step}) and `fraction` ({fraction}).")
        if self.needs_size and layers_per_step is None and fraction is None:
            raise ValueError(f"{type(self).__name__} needs `layers_per_step=k` or `fraction=f`; got neither.")
        if layers_per_step is not None:
            layers_per_step = check_int("layers_per_step", layers_per_step, 1)
        if fraction is not None and not (0.0 < float(fraction) <= 1.0):
            raise ValueError(f"`fraction` must be in (0, 1], got {fraction!r}.")
        self.layers_per_step = layers_per_step
        self.fraction = None if fraction is None else float(fraction)
        self.switch_every = check_int("switch_every", switch_every, 1)
        self.seed = int(seed)
        self.num_blocks = 0
        self.k = 0
        self._round = -1
        self._selection: Selection = ()

    def setup(self, num_blocks: int) -> None:
        """Bind the policy to a model with ``num_blocks`` blocks and resolve ``k``."""
        if num_blocks < 1:
            raise ValueError(f"A policy needs at least one block, got num_blocks={num_blocks}.")
        if self.layers_per_step is not None and self.layers_per_step > num_blocks:
            raise ValueError(f"`layers_per_step={self.layers_per_step}` exceeds the model's {num_blocks} blocks; "
                             f"allowed: 1..{num_blocks}.")
        self._bind(num_blocks)
        self._round, self._selection = -1, ()
        self._on_setup()

    def rebind(self, num_blocks: int) -> None:
        """Select, from now on, over the top ``num_blocks`` of the blocks bound so far (the lowest ones stopped
        training, or train again). What was learned of the kept blocks carries over; a round under way is chosen anew.

        Example::

            >>> from lcsb_lightning.policies import CyclicPolicy
            >>> policy = CyclicPolicy(layers_per_step=1)
            >>> policy.setup(num_blocks=4)
            >>> policy.select(0), policy.select(1)
            ((0,), (1,))
            >>> policy.rebind(num_blocks=2)  # the lowest 2 frozen: block 2 of the model is the policy's block 0
            >>> policy.select(1), policy.select(2)
            ((1,), (0,))
        """
        if self.num_blocks == 0:
            raise RuntimeError(f"{type(self).__name__}.setup(num_blocks) must be called before rebind().")
        if num_blocks < 1:
            raise ValueError(f"A policy needs at least one block, got num_blocks={num_blocks}.")
        dropped = self.num_blocks - num_blocks
        if dropped:
            self._bind(num_blocks)
            self._selection = ()
            self._on_rebind(dropped)

    def _bind(self, num_blocks: int) -> None:
        if self.layers_per_step is not None:
            k = min(self.layers_per_step, num_blocks)
        elif self.fraction is not None:
            k = max(1, round(self.fraction * num_blocks))
        else:
            k = num_blocks
        self.num_blocks, self.k = num_blocks, k

    def _on_setup(self) -> None:
        """Hook for subclasses: build per-model state after ``num_blocks`` and ``k`` are known."""

    def _on_rebind(self, dropped: int) -> None:
        """Hook for subclasses: :meth:`rebind` dropped the lowest ``dropped`` blocks (negative: added as many)."""
        self._on_setup()

    @property
    def cycle_steps(self) -> int | None:
        """Optimizer steps after which the selections repeat; ``None``: no fixed cycle, or not known before setup."""
        return None

    @property
    def num_groups(self) -> int:
        """Rounds needed to visit every block once with ``k`` blocks per round."""
        return math.ceil(self.num_blocks / self.k)

    def select(self, step: int) -> Selection:
        """Sorted block indices to back-propagate at optimizer step ``step``."""
        if self.num_blocks == 0:
            raise RuntimeError(f"{type(self).__name__}.setup(num_blocks) must be called before select().")
        target = step // self.switch_every
        if target == self._round and not self._selection:  # a round under way when rebind() dropped its blocks
            self._round -= 1
        if target < self._round:
            raise ValueError(f"select() went back in time: step {step} (round {target}) after round {self._round}. "
                             "Restore the policy with load_state_dict() instead.")
        while self._round < target:  # advancing round by round keeps stateful policies reproducible
            self._round += 1
            self._selection = tuple(sorted(self._choose(self._round)))
        return self._selection

    @abstractmethod
    def _choose(self, round_index: int) -> list[int]:
        """Blocks for round ``round_index`` (called once per round, in order)."""

    def observe(self, grad_norms: dict[int, float]) -> None:
        """Receive the gradient norm of each block trained this step (after gradient synchronisation)."""

    def state_dict(self) -> dict[str, Any]:
        return {"round": self._round, "selection": list(self._selection), "num_blocks": self.num_blocks, "k": self.k,
                **{name: getattr(self, name) for name in (*self.state_args, *self.changeable_args)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; other :attr:`changeable_args` continue with this policy's values, with a warning.

        Raises:
            ValueError: the checkpoint was saved over another model or with other :attr:`state_args`.
        """
        ours = {name: getattr(self, name) for name in ("num_blocks", *self.state_args, *self.changeable_args)}
        refused = [name for name in ("num_blocks", *self.state_args) if name in state and state[name] != ours[name]]
        if refused:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint has {_values(state, refused)}, this policy has "
                f"{_values(ours, refused)}, and what the checkpoint saved means something else under other values. "
                f"To resume it, {_how_to_resume(state, refused)}."
            )
        notes = []
        changed = [name for name in self.changeable_args if name in state and state[name] != ours[name]]
        if changed:
            notes.append(f"the checkpoint saved with {_values(state, changed)} continues under "
                         f"{_values(ours, changed)} (what it saved stays valid under them)")
        missing = [name for name in (*self.state_args, *self.changeable_args) if name not in state]
        if missing:
            notes.append(f"the checkpoint does not record {', '.join(missing)} (saved by 0.7 or older); resuming "
                         f"with this policy's {_values(ours, missing)}")
        if notes:
            rank_zero_warn(f"{type(self).__name__}: {'; '.join(notes)}.")
        # a round counts `switch_every` steps: where that may change (Full, TopOnly), the round is chosen anew
        self._round = int(state["round"]) if "switch_every" in self.state_args else -1
        self._selection = tuple(state["selection"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k or self.layers_per_step or self.fraction}, switch_every={self.switch_every})"


_REGISTRY: dict[str, type[SelectionPolicy]] = {}
P = TypeVar("P", bound=type[SelectionPolicy])


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator adding a policy to the registry under ``name``."""

    def decorator(cls: P) -> P:
        if name in _REGISTRY and _REGISTRY[name].__qualname__ != cls.__qualname__:
            raise ValueError(f"A policy named {name!r} is already registered ({_REGISTRY[name].__name__}).")
        _REGISTRY[name] = cls
        return cls

    return decorator


def _values(values: dict[str, Any], names: list[str]) -> str:
    return ", ".join(f"{name}={values[name]!r}" for name in names)


def _how_to_resume(state: dict[str, Any], names: list[str]) -> str:
    """What resumes a refused checkpoint: the model it was saved from, the arguments it was saved with."""
    steps = []
    if "num_blocks" in names:
        steps.append(f"load it into the model it was saved from ({state['num_blocks']} blocks)")
    arguments = [f"`layers_per_step={state[name]!r}`" if name == "k" else f"`{name}={state[name]!r}`"
                 for name in names if name != "num_blocks"]
    if arguments:
        steps.append(f"build the policy with {', '.join(arguments)}")
    return " and ".join(steps)


def _given_sizes(layers_per_step: int | None, fraction: float | None) -> dict[str, Any]:
    """The size arguments given (not None), by name."""
    return {k: v for k, v in (("layers_per_step", layers_per_step), ("fraction", fraction)) if v is not None}


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def build_policy(name: str, layers_per_step: int | None = None, fraction: float | None = None,
                 **kwargs: Any) -> SelectionPolicy:
    """Build a registered policy by name, e.g. ``build_policy("cyclic", layers_per_step=4)``.

    Raises:
        ValueError: an unknown name, or a size (``layers_per_step`` / ``fraction``) for a policy that takes none.
    """
    if name not in _REGISTRY:
        raise ValueError(f"Unknown policy {name!r}; available: {', '.join(available_policies())}.")
    policy_class = _REGISTRY[name]
    sizes = _given_sizes(layers_per_step, fraction)
    if sizes and not policy_class.needs_size:
        sized = ", ".join(n for n in available_policies() if _REGISTRY[n].needs_size)
        size, value = next(iter(sizes.items()))
        raise ValueError(f"`{size}={value!r}` sizes the policies {sized}; {name!r} takes none.")
    return policy_class(**sizes, **kwargs)
