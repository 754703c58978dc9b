"""Plain-torch LCSB step logic, driven by ``LCSBCallback`` or by a hand-written training loop."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lcsb_lightning.blocks import BlockParams, BlocksSpec, grad_norms, map_trainable_params, shared_param_ids
from lcsb_lightning.policies import SelectionPolicy
from lcsb_lightning.selective import SelectiveBackprop

BACKWARD_MODES = ("identity", "selected_only", "all_reached")
#: What a trainable tensor that a step's backward did not reach gets as its gradient (see ``LCSBCallback``).
UNREACHED_MODES = ("skip_below", "implicit")


def validate_modes(backward: str, unreached: str) -> None:
    """Raise if ``backward`` or ``unreached`` is not a supported mode name."""
    for name, value, allowed in (("backward", backward, BACKWARD_MODES), ("unreached", unreached, UNREACHED_MODES)):
        if value not in allowed:
            raise ValueError(f"`{name}={value!r}` is not supported; allowed: {', '.join(allowed)}.")


class LCSBController:
    """Selects blocks per optimizer step and prepares the forward pass and the gradients accordingly.

    Call :meth:`begin_step` before each optimizer step's forward (repeats are no-ops, as under gradient accumulation),
    :meth:`before_optimizer_step` after backward and gradient synchronisation, and :meth:`release` at the end.

    Example::

        >>> from torch import nn
        >>> from lcsb_lightning.policies import CyclicPolicy
        >>> net = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(4)))
        >>> ctl = LCSBController(net, CyclicPolicy(layers_per_step=2))
        >>> ctl.begin_step(0)  # group (0, 1); `all_reached` also trains the blocks above it
        (0, 1, 2, 3)
        >>> ctl.begin_step(1)
        (2, 3)
        >>> ctl.release()
    """

    def __init__(self, model: nn.Module, policy: SelectionPolicy, backward: str = "all_reached",
                 unreached: str = "skip_below", blocks: BlocksSpec = "auto") -> None:
        validate_modes(backward, unreached)
        self.policy, self.backward, self.unreached = policy, backward, unreached
        self.block_params: BlockParams = map_trainable_params(model, blocks)
        policy.setup(self.block_params.num_blocks)
        self.trained_from = 0  # the policy's block 0 is this one: the blocks below are frozen
        self.selection: tuple[int, ...] = ()
        self.selection_counts = [0] * self.block_params.num_blocks
        self._hooks: list[Any] = []
        self._watched: set[int] = set()
        # this step's gradient norms, until an optimizer's step applies them (a vetoed step never does)
        self._unobserved: dict[int, float] | None = None
        self.selected_at_step = self.observed_at_step = -1
        # id(optimizer) -> (number of parameters, their ids): rebuilt only when its parameter count changes
        self._optimizer_param_ids: dict[int, tuple[int, frozenset[int]]] = {}
        # an embedding tied to the head gets the head's exact gradient even where the backward misses the lookup
        self._shared_param_ids = shared_param_ids(model)
        self.selective: SelectiveBackprop | None = SelectiveBackprop(
            self.block_params.blocks, self.block_params.params_per_block,
            "identity" if backward == "identity" else "selected_only",
        )

    @property
    def num_blocks(self) -> int:
        return self.block_params.num_blocks

    def missing_from(self, optimizers: Sequence[Optimizer]) -> list[str]:
        """Names of managed parameters that are in no param group of ``optimizers``."""
        present = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
        names = zip(self.block_params.names_per_block, self.block_params.params_per_block)
        return [name for block_names, params in names for name, p in zip(block_names, params) if id(p) not in present]

    def begin_step(self, step: int) -> tuple[int, ...] | None:
        """Select the blocks of optimizer step ``step``; returns the new selection, ``None`` if unchanged."""
        if step == self.selected_at_step:
            return None
        self._train_from(self._frozen_prefix())
        selection = tuple(self.trained_from + i for i in self.policy.select(step))
        if self.backward == "all_reached" and selection:
            # The exact backward runs from the top down to the lowest selected block anyway; every block
            # it passes gets its exact gradient almost for free (LoRA weight gradients are rank-r).
            selection = tuple(range(min(selection), self.num_blocks))
        if self.selective is not None:
            self.selective.set_selection(selection)
        for i in selection:
            self.selection_counts[i] += 1
        self.selection, self.selected_at_step, self._unobserved = selection, step, None
        return selection

    def _train_from(self, block: int) -> None:
        """Bind the policy over the blocks from ``block`` on (a frozen block, selected, would train nothing)."""
        if block != self.trained_from:
            self.policy.rebind(self.num_blocks - block)
            self.trained_from = block

    def _frozen_prefix(self) -> int:
        """How many of the lowest blocks have trainable parameters that all have ``requires_grad=False``."""
        for index, params in enumerate(self.block_params.params_per_block):
            if not params or any(p.requires_grad for p in params):
                return index
        return 0  # every block frozen: nothing to select over (ProgressiveFreezing refuses such a schedule)

    def before_optimizer_step(self, optimizer: Optimizer) -> dict[int, float] | None:
        """Read the selected blocks' gradient norms (once per step; returned, else ``None``), then give the
        trainable tensors this step's backward did not reach what ``unreached`` says. The policy observes the norms
        when an optimizer's step runs (a vetoed step teaches it nothing)."""
        norms = None
        if self.observed_at_step != self.selected_at_step:  # once per step, even with several optimizers
            self.observed_at_step = self.selected_at_step
            values = grad_norms([self.block_params.params_per_block[i] for i in self.selection])
            norms = dict(zip(self.selection, values))
            self._unobserved = {i - self.trained_from: norm for i, norm in norms.items()}
        if id(optimizer) not in self._watched:
            self._watched.add(id(optimizer))
            self._hooks.append(optimizer.register_step_post_hook(self._observe))
        chosen = set(self.selection)
        in_optimizer = self._param_ids(optimizer)
        # Identity-path blocks already hold exact zeros; the others may hold a gradient that passed through them,
        # not theirs to use this step. The last list: trainable tensors below the first block (an untied embedding).
        known_zero = self.backward == "identity"
        below = (
            [p for p in self.selective.params_below if id(p) not in self._shared_param_ids]
            if self.selective is not None and not self.selective.reaches_below else []
        )
        below_index = self.num_blocks
        for index, params in enumerate([*self.block_params.params_per_block, below]):
            if index in chosen:
                continue
            for p in params:
                if id(p) not in in_optimizer or not p.requires_grad:  # frozen since fit start: no update at all
                    continue
                if index == below_index and self.unreached == "skip_below":
                    p.grad = None
                elif p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif not known_zero:
                    p.grad.zero_()
        return norms

    def _observe(self, *args: Any) -> None:
        if self._unobserved is not None:
            self.policy.observe(self._unobserved)
            self._unobserved = None

    def _param_ids(self, optimizer: Optimizer) -> frozenset[int]:
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        cached = self._optimizer_param_ids.get(id(optimizer))
        if cached is None or cached[0] != count:  # first step, or param groups added (e.g. by a finetuning callback)
            cached = (count, frozenset(id(p) for group in optimizer.param_groups for p in group["params"]))
            self._optimizer_param_ids[id(optimizer)] = cached
        return cached[1]

    def release(self) -> None:
        """Leave the model and the optimizers as found: the forwards that were there before (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._watched = [], set()
        if self.selective is not None:
            self.selective.remove()
            self.selective = None

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "selection": list(self.selection),
                "selected_at_step": self.selected_at_step, "observed_at_step": self.observed_at_step,
                "selection_counts": list(self.selection_counts), "trained_from": self.trained_from}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._train_from(int(state.get("trained_from", 0)))  # 0.9.3 and older bound the policy to every block
        self.policy.load_state_dict(state["policy"])
        self.selection = tuple(state["selection"])
        self.selected_at_step = int(state["selected_at_step"])
        self.observed_at_step = int(state["observed_at_step"])
        self.selection_counts = list(state["selection_counts"])
        # a checkpoint of 0.5 also holds "steps_selected" and "last_grads" (update_scale, momentum="reuse")
