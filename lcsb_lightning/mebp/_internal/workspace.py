"""Reusable decompression buffers: after the first step no decompression allocates a fresh weight."""

from __future__ import annotations

import math
import threading
import weakref
from typing import Sequence

import torch


class DecompressionWorkspace:
    """Free flat buffers per dtype and device, lent out as views of the requested shape.

    A request takes the smallest free buffer that is large enough, or allocates one of exactly its size.
    Per dtype and device it keeps as many free buffers as were ever lent at once (the largest ones), at most
    ``max_free_per_key``: with ``keep_recomputed_weights=False`` one buffer, the largest weight's, serves every
    layer. A buffer never given back (a dropped graph) is freed by Python as usual.
    """

    def __init__(self, max_free_per_key: int = 8) -> None:
        if max_free_per_key < 1:
            raise ValueError(f"`max_free_per_key` must be >= 1, got {max_free_per_key}.")
        self.max_free_per_key = max_free_per_key
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        # Lent buffers by storage address, held weakly; aliases handed back (a view, autograd's unpacked
        # copy of the handle) share the address.
        self._lent: weakref.WeakValueDictionary[tuple[int, torch.device], torch.Tensor] = weakref.WeakValueDictionary()
        self._most_lent: dict[tuple[torch.dtype, torch.device], int] = {}  # the most lent at once, per key
        self._lock = threading.Lock()  # CUDA runs backward on autograd's own threads
        self.allocations = 0
        self.reuses = 0

    def borrow(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` (a view of a pooled flat buffer)."""
        dims = tuple(int(s) for s in shape)
        numel = math.prod(dims)
        key = (dtype, torch.device(device))
        with self._lock:
            free = self._free.get(key, [])
            fitting = [i for i, flat in enumerate(free) if flat.numel() >= numel]
            if fitting:
                self.reuses += 1
                flat = free.pop(min(fitting, key=lambda i: free[i].numel()))
            else:
                self.allocations += 1
                flat = None
        if flat is None:
            flat = torch.empty(numel, dtype=dtype, device=key[1])
        with self._lock:
            self._lent[(flat.untyped_storage().data_ptr(), flat.device)] = flat
            lent_now = sum(1 for lent in self._lent.values() if (lent.dtype, lent.device) == key)
            self._most_lent[key] = max(self._most_lent.get(key, 0), lent_now)
        return flat[:numel].view(dims)

    def give_back(self, tensor: torch.Tensor) -> None:
        """Return a tensor from :meth:`borrow` (or an alias of it), not to be used afterwards; others are ignored."""
        lent_key = (tensor.untyped_storage().data_ptr(), tensor.device)
        with self._lock:
            flat = self._lent.pop(lent_key, None)
            if flat is None:  # not lent by this workspace, or already given back
                return
            key = (flat.dtype, flat.device)
            free = self._free.setdefault(key, [])
            free.append(flat)
            if len(free) > min(self.max_free_per_key, self._most_lent[key]):  # drop the smallest
                del free[min(range(len(free)), key=lambda i: free[i].numel())]

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer this workspace keeps free or has lent out."""
        with self._lock:
            return [flat for free in self._free.values() for flat in free] + list(self._lent.values())

    def free_bytes(self) -> int:
        """Bytes held in free buffers."""
        with self._lock:
            return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)

    def __getstate__(self) -> dict[str, int]:
        """Copies (deepcopy, pickle) start with an empty pool of their own."""
        return {"max_free_per_key": self.max_free_per_key}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["max_free_per_key"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"DecompressionWorkspace(allocations={self.allocations}, reuses={self.reuses}, free_bytes={self.free_bytes()})"
