"""A blocks x steps image of which blocks trained, for TensorBoard."""

from __future__ import annotations

from typing import Sequence

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
