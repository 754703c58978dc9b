"""Plain-torch core of selective backpropagation: how a block that is not selected takes part in a step.

A *cut* block runs its forward under ``no_grad`` and its output enters the graph through
:class:`IdentityPath`: the value is the block's exact output, the backward passes the incoming
gradient unchanged to the block's input (the residual path) and gives each of the block's trainable
parameters an exact zero gradient. Nothing is stored, recomputed or decompressed for that block in
backward, ``requires_grad`` is never changed, and every trainable parameter receives a gradient at
every step, so plain DDP needs no ``find_unused_parameters`` and AdamW sees the zero of LCSB's
"implicit updates".

Each block carries one :class:`SelectiveLayer` in its :class:`~lcsb_lightning.forward_wrap.ForwardStack`,
in one of three modes:

========== ===================================================================================
``train``  selected: the block runs as usual
``skip``   the paper's identity path: always cut (approximate gradients for the blocks below)
``pass``   exact gradients: the block runs as usual when a gradient has to pass through it (a
           selected block or a trainable parameter lies below), and is cut otherwise, which
           changes no gradient
========== ===================================================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
from torch import nn

from lcsb_lightning.forward_wrap import ForwardStack, get_layer, install_layer, remove_layer

#: Name of LCSB's layer in a block's forward stack.
LAYER_NAME = "lcsb_selective"
MODES = ("train", "skip", "pass")


class IdentityPath(torch.autograd.Function):
    """``forward(h, o, *params) = o``; backward: ``g`` to ``h``, exact zeros to ``params``.

    The output is a detached alias of ``o`` (computed under ``no_grad``): bit-exact, no copy, and not a
    view, so in-place operations downstream are allowed. With ``o = h`` (a block that did run with a
    graph) it is a free pass-through that only adds the zero gradients of ``params``.
    """

    @staticmethod
    def forward(ctx: Any, hidden_in: torch.Tensor, block_out: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.params = params
        return block_out.detach()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = tuple(torch.zeros_like(p) if needed else None for p, needed in zip(ctx.params, ctx.needs_input_grad[2:]))
        return (grad_out if ctx.needs_input_grad[0] else None, None, *zeros)


def _hidden_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        return hidden
    raise TypeError(
        "A block that LCSB cuts must receive its hidden states as the first positional argument or as "
        "`hidden_states=`; got neither."
    )


def _replace_hidden(output: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``make`` to the hidden states of a block's ``output`` (a tensor, or a tuple/list led by one)."""
    if isinstance(output, torch.Tensor):
        return make(output)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return type(output)([make(output[0]), *output[1:]])
    raise TypeError(
        f"A block that LCSB manages must return a tensor or a tuple led by the hidden states, got {type(output).__name__}."
    )


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

    return _replace_hidden(output, attach)


class _Sinks:
    """Trainable parameters of cut blocks below any gradient path, waiting for one to carry their zeros.

    A cut block whose input needs no gradient returns a tensor that needs none either, so the blocks
    above it (the lowest selected one first) compute no input gradient they do not need. Its
    parameters' zero gradients ride instead on the first output above that does carry a gradient.
    """

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []

    def flush_into(self, output: Any) -> Any:
        if not self.pending:
            return output
        params, self.pending = self.pending, []

        def attach(hidden: torch.Tensor) -> torch.Tensor:
            return IdentityPath.apply(hidden, hidden, *params) if hidden.requires_grad else hidden

        return _replace_hidden(output, attach)


class SelectiveLayer:
    """LCSB's forward layer on one block (see the module docstring for the modes)."""

    name = LAYER_NAME
    persistent = False  # owned by one fit: copies and pickles of the model leave it out

    def __init__(self, params: Sequence[nn.Parameter] = (), sinks: _Sinks | None = None, first: bool = False) -> None:
        self.params = list(params)
        self.sinks = sinks if sinks is not None else _Sinks()
        self.first = first
        self.mode = "train"

    def cuts(self, hidden_in: torch.Tensor) -> bool:
        """Whether this call is cut (``no_grad`` forward + identity path) rather than run with a graph."""
        if self.mode == "train" or not torch.is_grad_enabled():
            return False
        return self.mode == "skip" or not hidden_in.requires_grad

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        if self.first:  # a new forward pass: nothing is pending from an earlier one
            self.sinks.pending = []
        if self.mode == "train":
            return self.sinks.flush_into(inner(*args, **kwargs))
        hidden_in = _hidden_input(args, kwargs)
        if not self.cuts(hidden_in):
            return self.sinks.flush_into(inner(*args, **kwargs))
        with torch.no_grad():
            output = inner(*args, **kwargs)
        trainable = [p for p in self.params if p.requires_grad]
        if not hidden_in.requires_grad:
            self.sinks.pending.extend(trainable)
            return output
        pending, self.sinks.pending = self.sinks.pending, []
        return identity_path_output(hidden_in, output, [*pending, *trainable])

    def __repr__(self) -> str:
        return f"SelectiveLayer(mode={self.mode!r}, params={len(self.params)})"


def cuts(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether LCSB cuts this call of ``block`` (False where LCSB is not installed)."""
    layer = get_layer(block, LAYER_NAME)
    if not isinstance(layer, SelectiveLayer) or layer.mode == "train" or not torch.is_grad_enabled():
        return False
    return layer.cuts(_hidden_input(args, kwargs))


def is_skipped(block: nn.Module) -> bool:
    """Whether ``block`` is outside LCSB's current selection (False when LCSB is not installed)."""
    layer = get_layer(block, LAYER_NAME)
    return isinstance(layer, SelectiveLayer) and layer.mode != "train"


class SelectiveBackprop:
    """Installs :class:`SelectiveLayer` on a list of blocks and switches which blocks are selected.

    Works without Lightning: ``set_selection`` before the forward pass decides which blocks are
    back-propagated. In evaluation (gradients disabled) every block runs unchanged.

    Args:
        blocks: The transformer blocks, in order.
        params_per_block: The trainable parameters of each block (they get zero gradients when cut).
        backward: ``"identity"`` (non-selected blocks use the identity path) or ``"exact"``
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

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        params_per_block: Sequence[Sequence[nn.Parameter]] | None = None,
        backward: str = "identity",
    ) -> None:
        if backward not in ("identity", "exact"):
            raise ValueError(f"`backward={backward!r}` is not supported; allowed: identity, exact.")
        self.blocks = list(blocks)
        params = params_per_block if params_per_block is not None else [[] for _ in self.blocks]
        if len(params) != len(self.blocks):
            raise ValueError(f"{len(params)} parameter lists for {len(self.blocks)} blocks.")
        self.backward = backward
        self.layers: list[SelectiveLayer] = []
        self._stacks: list[ForwardStack] = []
        sinks = _Sinks()
        try:
            for index, (block, block_params) in enumerate(zip(self.blocks, params)):
                layer = SelectiveLayer(block_params, sinks, first=index == 0)
                self._stacks.append(install_layer(block, layer))
                self.layers.append(layer)
        except BaseException:
            self.remove()
            raise

    def set_selection(self, selected: Iterable[int]) -> None:
        """Back-propagate through the ``selected`` block indices; the others follow ``backward``."""
        chosen = set(selected)
        other = "skip" if self.backward == "identity" else "pass"
        for index, layer in enumerate(self.layers):
            layer.mode = "train" if index in chosen else other

    def clear(self) -> None:
        """Back-propagate through every block (as if nothing were installed)."""
        for layer in self.layers:
            layer.mode = "train"

    def remove(self) -> None:
        """Remove the layers; each block's forward is exactly what it was before (idempotent)."""
        for block, stack in zip(self.blocks, self._stacks):
            remove_layer(block, LAYER_NAME, stack)
        self.layers, self._stacks = [], []
