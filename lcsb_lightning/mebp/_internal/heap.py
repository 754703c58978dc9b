"""Give freed heap memory back to the OS (glibc's ``malloc_trim``; a no-op with other allocators).

glibc keeps freed memory in its heaps for reuse. A training step allocates its activations,
gradients and temporaries among longer-lived tensors, so the freed pages stay resident: with the
allocator's defaults the RSS of a Qwen2.5-0.5B-shape MeBP run grew from 1.5 GB to over 2 GB in four
steps. ``QuantizedMeBP(release_heap=True)`` calls :func:`maybe_release_free_heap` before each
checkpointed block runs (forward and backward recompute). It trims only once the resident set has
grown by :data:`RELEASE_THRESHOLD_BYTES` since the last trim, which keeps the RSS flat without
re-faulting the same pages at every block. The state is per process, as the heap is.

glibc also serves an allocation above its mmap threshold from pages of its own, returned to the OS
when freed, but it raises that threshold to the size of each such block freed (up to 32 MiB), so
after the first step a block's activations and decompressed weights come from the heap, where their
freed pages stay resident between trims. :func:`map_large_allocations` (``MeBPConfig.map_large_allocations``)
fixes the threshold at :data:`MMAP_THRESHOLD_BYTES` (``mallopt(M_MMAP_THRESHOLD)``), once per process:
every large allocation then faults its pages in afresh, which lowers the peak and slows the step
(docs/mebp.md, "Memory").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from typing import Any, Callable

#: Growth of the resident set since the last trim that triggers the next one.
RELEASE_THRESHOLD_BYTES = 16 << 20
#: Allocations at least this large get pages of their own, returned to the OS when freed.
MMAP_THRESHOLD_BYTES = 256 << 10
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_lock = threading.Lock()
_rss_after_last_trim = 0


@functools.lru_cache(maxsize=None)
def _glibc(function: str) -> Callable[..., Any] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), function)
    except (OSError, AttributeError):  # not glibc
        return None


def _malloc_trim() -> Callable[[int], Any] | None:
    return _glibc("malloc_trim")


@functools.lru_cache(maxsize=1)
def map_large_allocations() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (once per process); whether it could."""
    mallopt = _glibc("mallopt")
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1


def heap_release_supported() -> bool:
    """Whether this process's allocator can be asked to return freed memory (glibc)."""
    return _malloc_trim() is not None


def resident_bytes() -> int | None:
    """The process's resident set size from ``/proc/self/statm`` (None where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def release_free_heap() -> None:
    """Return the free pages of every malloc arena to the OS now; a no-op without glibc."""
    global _rss_after_last_trim
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
        _rss_after_last_trim = resident_bytes() or 0


def maybe_release_free_heap(threshold: int = RELEASE_THRESHOLD_BYTES) -> bool:
    """:func:`release_free_heap` if the resident set grew by ``threshold`` bytes since the last trim
    (always, where the resident set cannot be read); returns whether it trimmed."""
    if _malloc_trim() is None:
        return False
    with _lock:
        rss = resident_bytes()
        if rss is not None and rss - _rss_after_last_trim < threshold:
            return False
        release_free_heap()
        return True
