"""Per-block gradient checkpointing that composes with LCSB's identity path.

Each block gets an instance-level ``forward`` wrapper. With gradients enabled, a block that LCSB
does not skip runs under non-reentrant :func:`torch.utils.checkpoint.checkpoint`, so backward
recomputes it (decompressing its weights again). Under ``no_grad`` (evaluation, or a block LCSB
skips when its wrapper sits outside this one) nothing is checkpointed; when this wrapper sits
outside LCSB's, a skipped block is passed straight to LCSB's wrapper, which runs it without graph.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lcsb_lightning.forward_wrap import has_wrapper, unwrap_forward, wrap_forward
from lcsb_lightning.mebp.stats import STATS, checkpoint_scope
from lcsb_lightning.selective import is_skipped

#: Marker attribute on an installed wrapper.
WRAPPER_ATTR = "_mebp_block_wrapper"
#: Cache keyword arguments that cannot be replayed by a recompute (as in transformers' own checkpointing).
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


def _first_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def install_block_wrappers(
    blocks: Sequence[nn.Module],
    checkpoint_blocks: bool,
    saved_tensors_context: Callable[[], ContextManager[Any]] | None = None,
) -> None:
    """Wrap each block's forward with checkpointing and/or a saved-tensor context (offload).

    Args:
        blocks: The transformer blocks, in order.
        checkpoint_blocks: Recompute each back-propagated block in backward.
        saved_tensors_context: Factory of a context (e.g. ``saved_tensors_hooks``) entered around a
            back-propagated block's forward: with checkpointing it receives the block's checkpoint
            inputs, without it every activation the block saves.

    Example::

        >>> blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        >>> install_block_wrappers(blocks, checkpoint_blocks=True)
        >>> remove_block_wrappers(blocks)
    """
    for block in blocks:
        if has_wrapper(block, WRAPPER_ATTR):
            raise RuntimeError(f"{type(block).__name__} already has QuantizedMeBP's block wrapper installed.")
        _install(block, checkpoint_blocks, saved_tensors_context)


def _install(
    block: nn.Module,
    checkpoint_blocks: bool,
    saved_tensors_context: Callable[[], ContextManager[Any]] | None,
) -> None:
    def make_wrapper(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or is_skipped(block):
                return inner(*args, **kwargs)
            context = saved_tensors_context() if saved_tensors_context is not None else contextlib.nullcontext()
            if not checkpoint_blocks:
                with context:
                    return inner(*args, **kwargs)
            for name in _CACHE_KWARGS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            calls = [0]
            device = _first_device(args, kwargs)

            def run(*run_args: Any, **run_kwargs: Any) -> Any:
                calls[0] += 1
                if calls[0] == 1:
                    with checkpoint_scope(recompute=False):
                        return inner(*run_args, **run_kwargs)
                with checkpoint_scope(recompute=True), STATS.time_recompute(device):
                    return inner(*run_args, **run_kwargs)

            with context:
                return checkpoint(run, *args, use_reentrant=False, **kwargs)

        return forward

    wrap_forward(block, make_wrapper, WRAPPER_ATTR)


def remove_block_wrappers(blocks: Sequence[nn.Module]) -> None:
    """Undo :func:`install_block_wrappers` where QuantizedMeBP's wrapper is the outermost forward."""
    for block in blocks:
        unwrap_forward(block, WRAPPER_ATTR)
