"""Blocks x steps images for TensorBoard: which blocks trained, and how faithful their gradients were."""

from __future__ import annotations

from typing import Any, Sequence

import torch


def selection_image(history: Sequence[Sequence[int]], num_blocks: int, scale: int = 4) -> torch.Tensor:
    """``uint8`` image (``HW``): row ``i`` (block ``i``, top row = last block), column ``t`` (a step);
    white where block ``i`` trained at step ``t``. Each cell is ``scale x scale`` pixels.

    Example::

        >>> selection_image([(0,), (1,)], num_blocks=2, scale=1).tolist()
        [[0, 255], [255, 0]]
    """
    grid = torch.zeros(num_blocks, max(len(history), 1), dtype=torch.uint8)
    for column, selected in enumerate(history):
        for block in selected:
            grid[num_blocks - 1 - block, column] = 255
    return grid.repeat_interleave(scale, dim=0).repeat_interleave(scale, dim=1)


def probe_image(results: Sequence[Any], num_blocks: int, scale: int = 4) -> torch.Tensor:
    """``uint8`` image (``HW``), one column per probe: gray level ``1 + 254 * (1 + cos) / 2`` of each probed
    block (white: cos 1, near black: cos -1; top row = last block); 0 where a block was not probed.

    Example::

        >>> from lcsb_lightning.probe import ProbeResult
        >>> probe_image([ProbeResult(0, {0: 1.0, 1: -1.0})], num_blocks=2, scale=1).tolist()
        [[1], [255]]
    """
    grid = torch.zeros(num_blocks, max(len(results), 1), dtype=torch.uint8)
    for column, result in enumerate(results):
        for block, cosine in result.cosine.items():
            grid[num_blocks - 1 - block, column] = 1 + round(254 * (1.0 + max(-1.0, min(1.0, cosine))) / 2)
    return grid.repeat_interleave(scale, dim=0).repeat_interleave(scale, dim=1)
