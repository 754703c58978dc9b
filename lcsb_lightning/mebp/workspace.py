"""Reusable decompression buffers, so that every decompression does not allocate a fresh weight.

A decompressed weight lives for one matmul (forward, backward), or from a block's backward
recompute to that layer's backward. Allocating it anew each time makes glibc's allocator keep the
freed buffers resident (its mmap threshold grows with the freed sizes, so later buffers come from
the heap and fragment it): hundreds of MB of RSS with the allocator's defaults. A
:class:`DecompressionWorkspace` keeps the free buffers per shape, dtype and device and lends them
out; the borrower gives a buffer back as soon as nothing will read it again. A buffer that is never
given back (a dropped graph) is freed by Python as usual, and the workspace allocates a new one.

Example::

    >>> workspace = DecompressionWorkspace()
    >>> first = workspace.borrow((4, 8), torch.float32, torch.device("cpu"))
    >>> workspace.give_back(first)
    >>> workspace.borrow((4, 8), torch.float32, torch.device("cpu")).data_ptr() == first.data_ptr()
    True
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]


class DecompressionWorkspace:
    """Free buffers per ``(shape, dtype, device)``; at most ``max_free_per_key`` kept per key.

    Args:
        max_free_per_key: Free buffers kept per shape (a checkpointed block holds one weight per
            Linear between its recompute and its backward, so a block's Linears of one shape can all
            be lent at once).
    """

    def __init__(self, max_free_per_key: int = 8) -> None:
        if max_free_per_key < 1:
            raise ValueError(f"`max_free_per_key` must be >= 1, got {max_free_per_key}.")
        self.max_free_per_key = max_free_per_key
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # CUDA runs backward on autograd's own threads
        self.allocations = 0
        self.reuses = 0

    def borrow(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape``; reused when one was given back, allocated otherwise."""
        key = (tuple(int(s) for s in shape), dtype, torch.device(device))
        with self._lock:
            free = self._free.get(key)
            if free:
                self.reuses += 1
                return free.pop()
            self.allocations += 1
        return torch.empty(key[0], dtype=dtype, device=key[2])

    def give_back(self, tensor: torch.Tensor) -> None:
        """Return a buffer from :meth:`borrow`; the caller must not read or write it afterwards."""
        key = (tuple(tensor.shape), tensor.dtype, tensor.device)
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) < self.max_free_per_key:
                free.append(tensor)

    def free_bytes(self) -> int:
        """Bytes held in free buffers."""
        with self._lock:
            return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)

    def clear(self) -> None:
        """Drop every free buffer (their memory goes back to the allocator)."""
        with self._lock:
            self._free.clear()

    def __getstate__(self) -> dict[str, int]:
        """Copies (deepcopy, pickle) start with an empty pool of their own."""
        return {"max_free_per_key": self.max_free_per_key}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["max_free_per_key"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"DecompressionWorkspace(allocations={self.allocations}, reuses={self.reuses}, free_bytes={self.free_bytes()})"
