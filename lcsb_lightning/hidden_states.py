"""A block's hidden states as LCSB's and the frozen prefix's wrappers see them: where they come in, how an
output's are replaced, which parameters a graph reaches, and whether a block recomputes under a reentrant checkpoint."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def hidden_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden states a block's call receives: its first positional argument or ``hidden_states=``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        return hidden
    raise TypeError(
        "A block that LCSB cuts must receive its hidden states as the first positional argument or as "
        "`hidden_states=`; got neither."
    )


def replace_hidden(output: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``make`` to the hidden states of a block's ``output`` (a tensor, or a tuple/list led by one)."""
    if isinstance(output, torch.Tensor):
        return make(output)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return type(output)([make(output[0]), *output[1:]])
    raise TypeError(
        f"A block that LCSB manages must return a tensor or a tuple led by the hidden states, got {type(output).__name__}."
    )


def trainable_leaves(tensor: torch.Tensor, limit: int = 10_000) -> list[torch.Tensor]:
    """The parameters that ``tensor``'s autograd graph accumulates gradients into, in discovery order; gives up
    after ``limit`` graph nodes (a graph that large is no embedding)."""
    found: dict[int, torch.Tensor] = {}
    stack, seen = [tensor.grad_fn], set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if isinstance(variable, nn.Parameter):
            found.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def uses_reentrant_checkpoint(block: nn.Module) -> bool:
    """Whether ``block`` is a Hugging Face block whose forward runs under a reentrant checkpoint."""
    if not getattr(block, "gradient_checkpointing", False) or not block.training:
        return False
    function = getattr(block, "_gradient_checkpointing_func", None)
    keywords = getattr(function, "keywords", None) or {}
    return bool(keywords.get("use_reentrant", False))
