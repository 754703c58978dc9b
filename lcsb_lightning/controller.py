"""Plain-torch LCSB step logic, driven by ``LCSBCallback`` or by a hand-written training loop."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lcsb_lightning.blocks import BlockParams, BlocksSpec, grad_norms, map_trainable_params
from lcsb_lightning.policies import SelectionPolicy
from lcsb_lightning.selective import SelectiveBackprop, normalize_backward

BACKWARD_MODES = ("identity", "selected_only", "all_reached")
MOMENTUM_MODES = ("implicit", "skip", "reset", "reuse")
#: what ``momentum_below`` may do to a trainable tensor below the blocks (it has no "selection" to leave)
MOMENTUM_BELOW_MODES = ("implicit", "skip")
UPDATE_SCALES = ("none", "sqrt_period")


def validate_modes(backward: str, momentum: str, update_scale: str = "none", momentum_below: str | None = None) -> str:
    """Raise if ``backward``, ``momentum``, ``update_scale`` or ``momentum_below`` is not a supported mode
    name (or they clash).

    Returns:
        ``backward`` under its current name (see :func:`normalize_backward`).
    """
    backward = normalize_backward(backward)
    if backward not in BACKWARD_MODES:
        raise ValueError(f"`backward={backward!r}` is not supported; allowed: {', '.join(BACKWARD_MODES)}.")
    if momentum not in MOMENTUM_MODES:
        raise ValueError(f"`momentum={momentum!r}` is not supported; allowed: {', '.join(MOMENTUM_MODES)}.")
    if momentum_below is not None and momentum_below not in MOMENTUM_BELOW_MODES:
        raise ValueError(
            f"`momentum_below={momentum_below!r}` is not supported; allowed: {', '.join(MOMENTUM_BELOW_MODES)} "
            "or None (as `momentum`)."
        )
    if momentum == "reuse" and momentum_below is None:
        raise ValueError(
            "`momentum_below=None` (as `momentum`) cannot reuse gradients below the blocks; with "
            f"`momentum='reuse'` give `momentum_below` one of: {', '.join(MOMENTUM_BELOW_MODES)}."
        )
    if update_scale not in UPDATE_SCALES:
        raise ValueError(f"`update_scale={update_scale!r}` is not supported; allowed: {', '.join(UPDATE_SCALES)}.")
    if update_scale != "none" and momentum != "implicit":
        raise ValueError(
            f"`update_scale={update_scale!r}` compensates what implicit momentum does to a block trained every "
            f"P-th step; it needs `momentum='implicit'`, got {momentum!r}."
        )
    return backward


class LCSBController:
    """Selects blocks per optimizer step and prepares the forward pass and the gradients accordingly.

    Call :meth:`begin_step` before the forward pass of each optimizer step (repeat calls with the
    same step are no-ops, as under gradient accumulation) and :meth:`before_optimizer_step` after
    backward and gradient synchronisation. :meth:`release` restores the model.

    ``requires_grad`` is never changed: blocks outside the selection are cut out of the graph by
    :class:`~lcsb_lightning.selective.SelectiveBackprop` and their trainable parameters receive an
    exact zero gradient in backward, so every parameter gets a gradient at every step (plain DDP works)
    and the optimizer's param groups stay as ``configure_optimizers`` built them.

    Example::

        >>> from torch import nn
        >>> from lcsb_lightning.policies import CyclicPolicy
        >>> net = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(4)))
        >>> opt = torch.optim.AdamW(net[1].parameters())
        >>> ctl = LCSBController(net, CyclicPolicy(layers_per_step=2), momentum="implicit")
        >>> ctl.begin_step(0, [opt])  # group (0, 1); `all_reached` also trains the blocks above it
        (0, 1, 2, 3)
        >>> ctl.begin_step(1, [opt])
        (2, 3)
        >>> ctl.release()
    """

    def __init__(
        self,
        model: nn.Module,
        policy: SelectionPolicy,
        backward: str = "all_reached",
        momentum: str = "implicit",
        blocks: BlocksSpec = "auto",
        update_scale: str = "none",
        momentum_below: str | None = "skip",
    ) -> None:
        backward = validate_modes(backward, momentum, update_scale, momentum_below)
        self.policy, self.backward, self.momentum, self.update_scale = policy, backward, momentum, update_scale
        self.momentum_below = momentum if momentum_below is None else momentum_below
        self.block_params: BlockParams = map_trainable_params(model, blocks)
        policy.setup(self.block_params.num_blocks)
        self.selection: tuple[int, ...] = ()
        self.selection_counts = [0] * self.block_params.num_blocks
        self.steps_selected = 0
        # id(optimizer) -> (parameter, its value before the step, the update's multiplier), during a step
        self._pending_updates: dict[int, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self._hooks: list[Any] = []
        self.selected_at_step = -1
        self.observed_at_step = -1
        # id(optimizer) -> (number of parameters, their ids): rebuilt only when its parameter count changes
        self._optimizer_param_ids: dict[int, tuple[int, frozenset[int]]] = {}
        # momentum="reuse": block index -> the gradients of its parameters the last step that trained it
        self.last_grads: dict[int, list[torch.Tensor | None]] = {}
        # parameters a model uses in two places (an input embedding tied to the head): a step whose backward
        # does not reach the lookup still gives them the head's exact gradient, which is theirs to use
        names_per_param = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        self._shared_param_ids = frozenset(i for i, count in names_per_param.items() if count > 1)
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

    def begin_step(self, step: int, optimizers: Sequence[Optimizer]) -> tuple[int, ...] | None:
        """Select the blocks of optimizer step ``step``; returns the new selection, ``None`` if unchanged."""
        if step == self.selected_at_step:
            return None
        previous, selection = self.selection, self.policy.select(step)
        if self.backward == "all_reached" and selection:
            # The exact backward runs from the top down to the lowest selected block anyway; every block
            # it passes gets its exact gradient almost for free (LoRA weight gradients are rank-r).
            selection = tuple(range(min(selection), self.num_blocks))
        chosen = set(selection)
        if self.selective is not None:
            self.selective.set_selection(selection)
        if self.momentum == "reset":
            for index in set(previous) - chosen:
                for p in self.block_params.params_per_block[index]:
                    for optimizer in optimizers:
                        optimizer.state.pop(p, None)
        for i in selection:
            self.selection_counts[i] += 1
        self.steps_selected += 1
        self.selection, self.selected_at_step = selection, step
        return selection

    def before_optimizer_step(self, optimizer: Optimizer) -> dict[int, float] | None:
        """Feed the policy the selected blocks' gradient norms (once per step; returned, else ``None``),
        then leave non-selected parameters a zero gradient (``implicit``) or none (``skip``/``reset``), and
        the trainable tensors below the blocks, on a step whose backward does not reach them, what
        ``momentum_below`` says."""
        norms = None
        if self.observed_at_step != self.selected_at_step:  # once per step, even with several optimizers
            self.observed_at_step = self.selected_at_step
            values = grad_norms([self.block_params.params_per_block[i] for i in self.selection])
            norms = dict(zip(self.selection, values))
            self.policy.observe(norms)
        chosen = set(self.selection)
        in_optimizer = self._param_ids(optimizer)
        # Identity-path blocks already hold exact zeros; the others a gradient passed through them
        # may have computed, which is not theirs to use this step. The last list: trainable tensors below
        # the first block (an embedding), which train on the steps whose backward reaches them (a tied one
        # also at every step, from the head).
        known_zero = self.backward == "identity"
        below = (
            [p for p in self.selective.params_below if id(p) not in self._shared_param_ids]
            if self.selective is not None and not self.selective.reaches_below else []
        )
        below_index = self.num_blocks
        if self.momentum == "reuse":
            self._remember_grads(chosen)
        for index, params in enumerate([*self.block_params.params_per_block, below]):
            if index in chosen:
                continue
            momentum = self.momentum_below if index == below_index else self.momentum
            remembered = self.last_grads.get(index) if momentum == "reuse" else None
            for position, p in enumerate(params):
                if id(p) not in in_optimizer or not p.requires_grad:  # frozen since fit start: no update at all
                    continue
                if momentum in ("skip", "reset"):
                    p.grad = None
                elif remembered is not None and remembered[position] is not None:
                    # a copy: gradient clipping scales p.grad in place, and the remembered one must stay raw
                    if p.grad is None:
                        p.grad = remembered[position].clone()
                    else:
                        p.grad.copy_(remembered[position])
                elif p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif not known_zero:
                    p.grad.zero_()
        return norms

    def _remember_grads(self, chosen: set[int]) -> None:
        """``momentum="reuse"``: keep the raw gradients of the blocks this step trains (before clipping)."""
        for index in chosen:
            params = self.block_params.params_per_block[index]
            kept = self.last_grads.setdefault(index, [None] * len(params))
            for position, p in enumerate(params):
                if p.grad is not None:  # into the buffer of the last time: no allocation per step
                    kept[position] = p.grad.detach().clone() if kept[position] is None else kept[position].copy_(p.grad)

    def update_multipliers(self) -> list[float]:
        """Per block, the factor ``update_scale`` multiplies its optimizer update by: ``sqrt(P)``, with ``P``
        the optimizer steps per selection of the block so far (1.0 everywhere with ``"none"``).

        With AdamW and implicit momentum a block trained every P-th step moves about ``1 / sqrt(P)`` as
        far per step as under full backprop (its first moment sums to one gradient per period, its second
        moment holds a P-th of the squared gradient), whatever the gradient's noise.
        """
        if self.update_scale == "none" or self.steps_selected == 0:
            return [1.0] * self.num_blocks
        return [math.sqrt(self.steps_selected / count) if count else 1.0 for count in self.selection_counts]

    def scale_updates_of(self, optimizers: Sequence[Optimizer]) -> None:
        """Scale every step of ``optimizers`` per block by :meth:`update_multipliers` (``update_scale``).

        The optimizers' own step hooks take each block's parameters when the step starts (under Lightning,
        before its closure runs the forward and backward) and rescale the update when it ends. A parameter
        left without a gradient got no update (a divergence guard skipped or rolled back the step, or
        ``momentum`` gave it none): it is left as the step left it.
        """
        if self.update_scale == "none":
            return
        for optimizer in optimizers:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_update))
            self._hooks.append(optimizer.register_step_post_hook(self._after_update))

    def _before_update(self, optimizer: Optimizer, *args: Any) -> None:
        in_optimizer = self._param_ids(optimizer)
        self._pending_updates[id(optimizer)] = [
            (p, p.detach().clone(), factor)
            for params, factor in zip(self.block_params.params_per_block, self.update_multipliers()) if factor != 1.0
            for p in params if id(p) in in_optimizer
        ]

    def _after_update(self, optimizer: Optimizer, *args: Any) -> None:
        with torch.no_grad():
            for p, before, factor in self._pending_updates.pop(id(optimizer), []):
                if p.grad is not None:
                    p.sub_(before).mul_(factor).add_(before)

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
        self._hooks = []
        if self.selective is not None:
            self.selective.remove()
            self.selective = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.state_dict(),
            "selection": list(self.selection),
            "selected_at_step": self.selected_at_step,
            "observed_at_step": self.observed_at_step,
            "selection_counts": list(self.selection_counts),
            "steps_selected": self.steps_selected,
            "last_grads": {index: list(grads) for index, grads in self.last_grads.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.selection = tuple(state["selection"])
        self.selected_at_step = int(state["selected_at_step"])
        self.observed_at_step = int(state["observed_at_step"])
        self.selection_counts = list(state["selection_counts"])
        self.steps_selected = int(state.get("steps_selected", max(self.selection_counts, default=0)))
        self.last_grads = {int(index): list(grads) for index, grads in state.get("last_grads", {}).items()}
