"""Activation memory of a float model bounded by the blocks a step keeps: the lower blocks recompute theirs.

Under LCSB's truncated backward only the deep steps back-propagate every block: a step no deeper than ``keep_top``
is unchanged, a deeper one recomputes its lower blocks' forward in backward (QuantizedMeBP's per-block checkpoint).
"""

from __future__ import annotations

from torch import nn

from lcsb_lightning.blocks import BlocksSpec, find_blocks


def recompute_lower_blocks(model: nn.Module, keep_top: int | None = None, blocks: BlocksSpec = "auto",
                           release_heap: bool = True) -> list[nn.Module]:
    """Checkpoint every transformer block of ``model`` below its top ``keep_top`` (None: none).

    Args:
        model: A float model (not one ``QuantizedMeBP`` converts: it checkpoints every block already).
        keep_top: Blocks, counted from the top, that keep their activations for backward (None: all of them).
        blocks: How to find the blocks (:func:`~lcsb_lightning.blocks.find_blocks`).
        release_heap: On the CPU, return the freed heap to the OS around each block that runs with a graph.

    Returns:
        The blocks that recompute their activations, bottom first.

    Raises:
        ValueError: ``keep_top`` is not None and not an integer >= 1.
        RuntimeError: the blocks already carry a per-block checkpoint (this function's, or QuantizedMeBP's).

    Example::

        >>> net = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(6)))
        >>> len(recompute_lower_blocks(net, keep_top=2))
        4
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
