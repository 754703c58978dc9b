"""Per-block non-reentrant gradient checkpointing (and heap trims, saved-tensor offload) as a forward wrapper
that composes with LCSB's in either order: a block LCSB cuts, or any block under ``no_grad``, is not checkpointed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lcsb_lightning.forward_wrap import get_wrapper, install_wrapper
from lcsb_lightning.mebp._internal.heap import start_forward_pass, trim_heap_before_backward, trim_heap_if_grown
from lcsb_lightning.mebp._internal.stats import MeBPStats, checkpoint_scope
from lcsb_lightning.prefix_cache import is_frozen
from lcsb_lightning.selective import cuts

#: Name of QuantizedMeBP's wrapper in a block's forward stack.
CHECKPOINT_WRAPPER = "mebp_checkpoint"
#: Cache keyword arguments that cannot be replayed by a recompute (as in transformers' own checkpointing).
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


def _first_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    return next((v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), torch.device("cpu"))


class BlockCheckpoint:
    """QuantizedMeBP's forward wrapper on one transformer block: checkpointing and/or a saved-tensor context.

    Args:
        checkpoint_blocks: Recompute the block in backward (non-reentrant checkpoint).
        saved_tensors_context: Factory of a context (``saved_tensors_hooks``) entered around a back-propagated
            block's forward: it receives the checkpoint inputs, or without checkpointing every saved activation.
        stats: Receives the recompute timings.
        release_heap: On CPU, trim the heap around the block's forward with gradients and before its recompute.
        starts_pass: The lowest block: each call starts a forward pass of the trims (``heap.start_forward_pass``).
    """

    name = CHECKPOINT_WRAPPER
    persistent = True  # part of the converted model: copies and pickles keep it

    def __init__(self, block: nn.Module, checkpoint_blocks: bool,
                 saved_tensors_context: Callable[[], ContextManager[Any]] | None = None, stats: MeBPStats | None = None,
                 release_heap: bool = True, starts_pass: bool = False) -> None:
        self.block = block
        self.checkpoint_blocks = checkpoint_blocks
        self.saved_tensors_context = saved_tensors_context
        self.stats = stats
        self.release_heap = release_heap
        self.starts_pass = starts_pass

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.starts_pass:
            start_forward_pass()
        device = _first_device(args, kwargs)
        release = self.release_heap and torch.is_grad_enabled() and device.type == "cpu"
        if release:
            trim_heap_if_grown()
        output = self._run(inner, device, *args, **kwargs)
        if release:
            # What the block freed leaves before the next one runs (which trims again only after more
            # growth) and, after the last block, before the loss: its window holds the previous step's
            # gradients, which Lightning zeroes only after training_step.
            trim_heap_if_grown()
        return output

    def _run(self, inner: Callable[..., Any], device: torch.device, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or cuts(self.block) or is_frozen(self.block):
            return inner(*args, **kwargs)
        context = self.saved_tensors_context() if self.saved_tensors_context is not None else contextlib.nullcontext()
        if not self.checkpoint_blocks:
            with context:
                return inner(*args, **kwargs)
        kwargs.update({name: None for name in _CACHE_KWARGS if kwargs.get(name) is not None})
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        with context:
            recompute = _Recompute(inner, device, self.stats, self.release_heap)
            return checkpoint(recompute, *args, use_reentrant=False, **kwargs)


class _Recompute:
    """The checkpointed function: its first call is the forward, later calls are backward recomputes."""

    def __init__(self, inner: Callable[..., Any], device: torch.device, stats: MeBPStats | None, release_heap: bool) -> None:
        self.inner, self.device, self.stats, self.calls = inner, device, stats, 0
        self.release_heap = release_heap

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            with checkpoint_scope(recompute=False):
                return self.inner(*args, **kwargs)
        if self.release_heap and self.device.type == "cpu":
            trim_heap_before_backward()
        timer = self.stats.time_recompute(self.device) if self.stats is not None else contextlib.nullcontext()
        with checkpoint_scope(recompute=True), timer:
            return self.inner(*args, **kwargs)


def install_block_wrappers(blocks: Sequence[nn.Module], checkpoint_blocks: bool,
                           saved_tensors_context: Callable[[], ContextManager[Any]] | None = None,
                           stats: MeBPStats | None = None, release_heap: bool = True) -> None:
    """Install a :class:`BlockCheckpoint` on each block; the lowest starts each forward pass of the heap trims."""
    for block in blocks:
        if get_wrapper(block, CHECKPOINT_WRAPPER) is not None:
            raise RuntimeError(f"{type(block).__name__} already has QuantizedMeBP's block checkpoint wrapper installed.")
    for index, block in enumerate(blocks):
        install_wrapper(block, BlockCheckpoint(block, checkpoint_blocks, saved_tensors_context, stats, release_heap,
                                               starts_pass=index == 0))
