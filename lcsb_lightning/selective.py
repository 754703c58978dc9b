"""Plain-torch core of selective backpropagation: the identity-path forward of skipped blocks.

A skipped block runs under ``no_grad`` and its output enters the graph through :class:`IdentityPath`,
whose forward returns the block's exact output and whose backward passes the incoming gradient
unchanged to the block's input. That is ``h + (o - h).detach()`` without the rounding of the extra
add and subtract: no activation is stored, nothing is recomputed and no frozen weight is decompressed
in backward for that block.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from lcsb_lightning.forward_wrap import unwrap_forward, wrap_forward

#: Attribute set on each managed block; other wrappers (QuantizedMeBP's checkpointing) read it.
SKIP_ATTR = "_lcsb_skipped"
_WRAPPER_MARKER = "_lcsb_identity_path"


class IdentityPath(torch.autograd.Function):
    """``forward(h, o) = o``; ``backward(g) = (g, None)``: exact value, identity Jacobian."""

    @staticmethod
    def forward(ctx: Any, hidden_in: torch.Tensor, block_out: torch.Tensor) -> torch.Tensor:
        return block_out.view_as(block_out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_out, None


def _hidden_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        return hidden
    raise TypeError(
        "A skipped block must receive its hidden states as the first positional argument or as "
        "`hidden_states=`; got neither."
    )


def identity_path_output(hidden_in: torch.Tensor, output: Any) -> Any:
    """Replace the hidden states in ``output`` (a tensor or a tuple/list led by one) by the identity path."""
    if isinstance(output, torch.Tensor):
        return _attach(hidden_in, output)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return type(output)([_attach(hidden_in, output[0]), *output[1:]])
    raise TypeError(
        f"A skipped block must return a tensor or a tuple led by the hidden states, got {type(output).__name__}."
    )


def _attach(hidden_in: torch.Tensor, block_out: torch.Tensor) -> torch.Tensor:
    if block_out.shape != hidden_in.shape:
        raise ValueError(
            f"The identity path needs a residual block (output shape == input shape); got input "
            f"{tuple(hidden_in.shape)} and output {tuple(block_out.shape)}."
        )
    if not hidden_in.requires_grad:
        return block_out
    return IdentityPath.apply(hidden_in, block_out)


class SelectiveBackprop:
    """Installs identity-path forwards on a list of blocks and switches which blocks are skipped.

    Works without Lightning: ``set_selection`` before the forward pass decides which blocks are
    back-propagated. Blocks outside the selection run under ``no_grad`` while gradients are enabled;
    in evaluation (grad disabled) every block runs unchanged.

    Example::

        >>> from torch import nn

from lcsb_lightning.forward_wrap import unwrap_forward, wrap_forward
        >>> blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        >>> sb = SelectiveBackprop(blocks)
        >>> sb.set_selection([1])
        >>> h = torch.randn(2, 4, requires_grad=True)
        >>> for block in blocks:
        ...     h = h + block(h)  # blocks 0 and 2 add their output with an identity Jacobian
        >>> sb.remove()
    """

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self.blocks = list(blocks)
        self._installed: list[nn.Module] = []
        for block in self.blocks:
            if SKIP_ATTR in vars(block):
                raise RuntimeError(f"{type(block).__name__} already has selective backprop installed.")
            self._install(block)

    def _install(self, block: nn.Module) -> None:
        def make_wrapper(inner: Callable[..., Any]) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                if not (getattr(block, SKIP_ATTR) and torch.is_grad_enabled()):
                    return inner(*args, **kwargs)
                hidden_in = _hidden_input(args, kwargs)
                with torch.no_grad():
                    output = inner(*args, **kwargs)
                return identity_path_output(hidden_in, output)

            return forward

        wrap_forward(block, make_wrapper, _WRAPPER_MARKER)
        setattr(block, SKIP_ATTR, False)
        self._installed.append(block)

    def set_selection(self, selected: Iterable[int]) -> None:
        """Back-propagate through ``selected`` block indices; skip the others."""
        chosen = set(selected)
        for index, block in enumerate(self.blocks):
            setattr(block, SKIP_ATTR, index not in chosen)

    def clear(self) -> None:
        """Back-propagate through every block (as if nothing were installed)."""
        self.set_selection(range(len(self.blocks)))

    def remove(self) -> None:
        """Restore the blocks' original forwards."""
        for block in self._installed:
            unwrap_forward(block, _WRAPPER_MARKER)
            if SKIP_ATTR in vars(block):
                delattr(block, SKIP_ATTR)
        self._installed.clear()


def is_skipped(block: nn.Module) -> bool:
    """Whether LCSB currently skips ``block`` in backward (False when LCSB is not installed)."""
    return bool(getattr(block, SKIP_ATTR, False))
