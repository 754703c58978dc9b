"""Activation memory of a float model bounded by the blocks a step keeps: the lower blocks recompute theirs.

Under LCSB's exact truncated backward a step back-propagates its top ``depth`` blocks, so only the
deep steps (the dyadic schedule's full-depth step, one in four by default) store the activations of
every block. :func:`recompute_lower_blocks` keeps the activations of the top ``keep_top`` blocks and
runs every block below them under a non-reentrant checkpoint (QuantizedMeBP's per-block wrapper,
without compression): a step whose depth is at most ``keep_top`` computes exactly what it did
(the lower blocks run without a graph anyway), and a deeper step recomputes the forward of its
blocks below the top ``keep_top`` in backward. The gradients are the same; the activations stored are
those of ``keep_top`` blocks, plus one hidden state per block below.

On the CPU each block also returns the heap that the block before it freed to the OS
(``release_heap``; glibc only), through the same wrapper as QuantizedMeBP's and the same trims
(:mod:`~lcsb_lightning.mebp._internal.heap`); the lowest block starts each forward pass of them, as there.
Between the steps :class:`~lcsb_lightning.heap_trim.HeapTrim` trims, for float and compressed models alike.
"""

from __future__ import annotations

from torch import nn

from lcsb_lightning.blocks import BlocksSpec, find_blocks


def recompute_lower_blocks(
    model: nn.Module, keep_top: int | None = None, blocks: BlocksSpec = "auto", release_heap: bool = True
) -> list[nn.Module]:
    """Checkpoint every transformer block of ``model`` below its top ``keep_top`` (None: none).

    Args:
        model: A float model (a Hugging Face causal LM, optionally wrapped by peft). A model that
            ``QuantizedMeBP`` converts already checkpoints every block: do not use both.
        keep_top: Blocks, counted from the top (nearest the loss), that keep their activations for
            backward; the blocks below recompute theirs. None, or at least the number of blocks: all keep theirs.
        blocks: How to find the blocks (:func:`~lcsb_lightning.blocks.find_blocks`).
        release_heap: On the CPU, return the freed heap to the OS around each block that runs with a graph.

    Returns:
        The blocks that recompute their activations, bottom first.

    Raises:
        ValueError: ``keep_top`` is not None and not an integer >= 1.
        RuntimeError: the blocks already carry a per-block checkpoint (this function's, or QuantizedMeBP's).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
        ...     def forward(self, x):
        ...         for layer in self.layers:
        ...             x = layer(x)
        ...         return x
        >>> net = Net()
        >>> len(recompute_lower_blocks(net, keep_top=2))
        4
        >>> net(torch.ones(1, 4, requires_grad=True)).sum().backward()
    """
    if keep_top is not None and (isinstance(keep_top, bool) or not isinstance(keep_top, int) or keep_top < 1):
        raise ValueError(f"`keep_top` must be None or an integer >= 1, got {keep_top!r}.")
    from lcsb_lightning.mebp._internal.checkpoint import CHECKPOINT_WRAPPER, BlockCheckpoint
    from lcsb_lightning.forward_wrap import get_wrapper, install_wrapper

    found = find_blocks(model, blocks)
    if any(get_wrapper(block, CHECKPOINT_WRAPPER) is not None for block in found):
        raise RuntimeError(
            "the model's blocks already carry a per-block checkpoint (recompute_lower_blocks, or QuantizedMeBP's, "
            "which recomputes every block): apply recompute_lower_blocks once, and only to a model QuantizedMeBP does not convert."
        )
    lower = max(0, len(found) - keep_top) if keep_top is not None else 0
    for index, block in enumerate(found):
        wrapper = BlockCheckpoint(block, checkpoint_blocks=index < lower, release_heap=release_heap, starts_pass=index == 0)
        install_wrapper(block, wrapper)
    return found[:lower]
