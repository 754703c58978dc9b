"""Plain-torch core of selective backpropagation: how a block that is not selected takes part in a step.

A *cut* block runs under ``no_grad`` and its output enters the graph through :class:`IdentityPath` (exact zero
gradients to its parameters). Each block's :class:`SelectiveForward` is in one mode: ``train`` (selected), ``skip``
(the paper's identity path: always cut) or ``pass`` (runs as usual above the lowest selected block, cut below it).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
from torch import nn

from lcsb_lightning.forward_wrap import ForwardStack, get_wrapper, install_wrapper, remove_wrapper
from lcsb_lightning.hidden_states import hidden_input, replace_hidden, trainable_leaves, uses_reentrant_checkpoint

#: Name of LCSB's wrapper in a block's forward stack.
SELECTIVE_WRAPPER = "lcsb_selective"


class IdentityPath(torch.autograd.Function):
    """``forward(h, o, *params) = o``; backward: ``g`` to ``h``, exact zeros to ``params``.

    The output is a detached alias of ``o``: bit-exact, no copy, not a view (in-place operations downstream are
    allowed). With ``o = h`` it only adds the zero gradients of ``params``.
    """

    @staticmethod
    def forward(ctx: Any, hidden_in: torch.Tensor, block_out: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.params = params
        return block_out.detach()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = tuple(torch.zeros_like(p) if needed else None for p, needed in zip(ctx.params, ctx.needs_input_grad[2:]))
        return (grad_out if ctx.needs_input_grad[0] else None, None, *zeros)


def identity_path_output(hidden_in: torch.Tensor, output: Any, params: Sequence[torch.Tensor] = ()) -> Any:
    """``output`` with its hidden states attached to ``hidden_in`` by the identity path (zeros to ``params``)."""

    def attach(block_out: torch.Tensor) -> torch.Tensor:
        if block_out.shape != hidden_in.shape:
            raise ValueError(
                f"The identity path needs a residual block (output shape == input shape); got input "
                f"{tuple(hidden_in.shape)} and output {tuple(block_out.shape)}."
            )
        trainable = [p for p in params if p.requires_grad]
        if not hidden_in.requires_grad and not trainable:
            return block_out
        return IdentityPath.apply(hidden_in, block_out, *trainable)

    return replace_hidden(output, attach)


class _Sinks:
    """What the cut blocks of one forward pass share.

    Attributes:
        pending: Tensors whose zero gradients wait for the next output that requires grad (a block cut below the
            selection returns one that needs none, so the blocks above compute no input gradient they do not need).
        lowest: Index of the lowest block the exact backward reaches (``pass`` blocks below it are cut).
        leaf_for_reentrant: Whether the block just below ``lowest`` must return a leaf that requires grad
            (the lowest selected block runs under a reentrant checkpoint).
        below: Trainable parameters found below the blocks by the first cut that saw them.
    """

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []
        self.lowest = 0
        self.leaf_for_reentrant = False
        self.below: list[torch.Tensor] | None = None
        self.uncut_reported = False

    def warn_uncut(self, index: int) -> None:
        if not self.uncut_reported:
            self.uncut_reported = True
            warnings.warn(
                f"LCSB cannot cut block {index} (nor any block run the same way): it runs under a reentrant "
                "activation checkpoint applied outside it, whose forward has gradients disabled, so its backward "
                "runs whatever the selection and selective backprop saves nothing there. Use "
                "`use_reentrant=False`, or Hugging Face's `activation_checkpointing_enable()` (LCSB cuts its "
                "blocks before they reach the checkpoint).",
                stacklevel=2,
            )

    def flush_into(self, output: Any) -> Any:
        if not self.pending:
            return output
        params, self.pending = self.pending, []

        def attach(hidden: torch.Tensor) -> torch.Tensor:
            return IdentityPath.apply(hidden, hidden, *params) if hidden.requires_grad else hidden

        return replace_hidden(output, attach)


class SelectiveForward:
    """LCSB's forward wrapper on one block (see the module docstring for the modes)."""

    name = SELECTIVE_WRAPPER
    persistent = False  # owned by one fit: copies and pickles of the model leave it out

    def __init__(self, params: Sequence[nn.Parameter] = (), sinks: _Sinks | None = None, first: bool = False,
                 index: int = 0) -> None:
        self.params = list(params)
        self.sinks = sinks if sinks is not None else _Sinks()
        self.first = first
        self.index = index
        self.mode = "train"

    def cuts(self) -> bool:
        """Whether this call is cut (``no_grad`` forward, no backward) rather than run with a graph."""
        if self.mode == "train" or not torch.is_grad_enabled():
            return False
        return self.mode == "skip" or self.index < self.sinks.lowest

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        cut = self.cuts()
        if cut and _in_backward():
            # A reentrant checkpoint applied outside this wrapper ran the forward without gradients, so
            # nothing was cut, and now recomputes it in backward: it must run as it did.
            self.sinks.warn_uncut(self.index)
            return inner(*args, **kwargs)
        if self.first:  # a new forward pass: nothing is pending from an earlier one
            self.sinks.pending = []
        if not cut:
            return self.sinks.flush_into(inner(*args, **kwargs))
        hidden_in = hidden_input(args, kwargs)
        with torch.no_grad():
            output = inner(*args, **kwargs)
        trainable = [p for p in self.params if p.requires_grad]
        if self.mode == "pass":  # below the exact backward: nothing here or underneath needs a gradient
            if hidden_in.grad_fn is not None:  # a trainable graph below (an embedding): exact zeros for it
                self.sinks.pending.append(hidden_in)
                if self.sinks.below is None:
                    self.sinks.below = trainable_leaves(hidden_in)
            self.sinks.pending.extend(trainable)
            if self.sinks.leaf_for_reentrant and self.index == self.sinks.lowest - 1:
                return replace_hidden(output, lambda hidden: hidden.requires_grad_())
            return output
        if not hidden_in.requires_grad:
            self.sinks.pending.extend(trainable)
            return output
        pending, self.sinks.pending = self.sinks.pending, []
        return identity_path_output(hidden_in, output, [*pending, *trainable])

    def __repr__(self) -> str:
        return f"SelectiveForward(mode={self.mode!r}, index={self.index}, params={len(self.params)})"


def _in_backward() -> bool:
    """Whether the caller runs inside autograd's backward (a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


def cuts(block: nn.Module) -> bool:
    """Whether LCSB cuts this call of ``block`` (False where LCSB is not installed)."""
    wrapper = get_wrapper(block, SELECTIVE_WRAPPER)
    return isinstance(wrapper, SelectiveForward) and wrapper.cuts()


def is_skipped(block: nn.Module) -> bool:
    """Whether ``block`` is outside LCSB's current selection (False when LCSB is not installed)."""
    wrapper = get_wrapper(block, SELECTIVE_WRAPPER)
    return isinstance(wrapper, SelectiveForward) and wrapper.mode != "train"


class SelectiveBackprop:
    """Installs :class:`SelectiveForward` on a list of blocks and switches which blocks are selected.

    Args:
        blocks: The transformer blocks, in order.
        params_per_block: The trainable parameters of each block (they get zero gradients when cut).
        backward: ``"identity"`` (non-selected blocks use the identity path) or ``"selected_only"``
            (non-selected blocks keep exact gradients flowing to the selected ones).

    Example::

        >>> from torch import nn
        >>> blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        >>> sb = SelectiveBackprop(blocks, [list(b.parameters()) for b in blocks])
        >>> sb.set_selection([1])
        >>> h = torch.randn(2, 4, requires_grad=True)
        >>> for block in blocks:
        ...     h = h + block(h)  # blocks 0 and 2 add their output with an identity Jacobian
        >>> h.sum().backward()
        >>> float(blocks[0].weight.grad.abs().sum()), float(blocks[1].weight.grad.abs().sum()) > 0
        (0.0, True)
        >>> sb.remove()
    """

    def __init__(self, blocks: Sequence[nn.Module], params_per_block: Sequence[Sequence[nn.Parameter]] | None = None,
                 backward: str = "identity") -> None:
        if backward not in ("identity", "selected_only"):
            raise ValueError(f"`backward={backward!r}` is not supported; allowed: identity, selected_only.")
        self.blocks = list(blocks)
        params = params_per_block if params_per_block is not None else [[] for _ in self.blocks]
        if len(params) != len(self.blocks):
            raise ValueError(f"{len(params)} parameter lists for {len(self.blocks)} blocks.")
        self.backward = backward
        self.selected: tuple[int, ...] | None = None  # None: every block trains
        self.wrappers: list[SelectiveForward] = []
        self._stacks: list[ForwardStack] = []
        self.sinks = _Sinks()
        try:
            for index, (block, block_params) in enumerate(zip(self.blocks, params)):
                wrapper = SelectiveForward(block_params, self.sinks, first=index == 0, index=index)
                self._stacks.append(install_wrapper(block, wrapper))
                self.wrappers.append(wrapper)
        except BaseException:
            self.remove()
            raise

    def set_selection(self, selected: Iterable[int]) -> None:
        """Back-propagate through the ``selected`` block indices; the others follow ``backward``."""
        chosen = set(selected)
        self.selected = tuple(sorted(chosen))
        other = "skip" if self.backward == "identity" else "pass"
        for index, wrapper in enumerate(self.wrappers):
            wrapper.mode = "train" if index in chosen else other
        self.sinks.lowest = min(chosen, default=len(self.wrappers)) if other == "pass" else 0
        lowest = self.sinks.lowest
        self.sinks.leaf_for_reentrant = 0 < lowest < len(self.blocks) and uses_reentrant_checkpoint(self.blocks[lowest])

    @property
    def reaches_below(self) -> bool:
        """Whether this step's backward reaches what lies below the first block (a trainable embedding)."""
        return self.sinks.lowest == 0

    @property
    def params_below(self) -> list[torch.Tensor]:
        """Trainable tensors found below the first block (empty until a step cut above them)."""
        return list(self.sinks.below or [])

    def clear(self) -> None:
        """Back-propagate through every block (as if nothing were installed)."""
        for wrapper in self.wrappers:
            wrapper.mode = "train"
        self.selected = None
        self.sinks.lowest, self.sinks.leaf_for_reentrant = 0, False

    def remove(self) -> None:
        """Remove the wrappers; each block's forward is exactly what it was before (idempotent)."""
        for block, stack in zip(self.blocks, self._stacks):
            remove_wrapper(block, SELECTIVE_WRAPPER, stack)
        self.wrappers, self._stacks = [], []
