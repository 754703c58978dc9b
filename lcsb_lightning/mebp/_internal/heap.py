"""Give freed heap memory back to the OS (glibc's ``malloc_trim``; a no-op with other allocators).

glibc keeps freed memory in its heaps for reuse. A training step allocates its activations,
gradients and temporaries among longer-lived tensors, so the freed pages stay resident: with the
allocator's defaults the RSS of a Qwen2.5-0.5B-shape MeBP run grew from 1.5 GB to over 2 GB in four
steps. ``QuantizedMeBP(release_heap=True)`` calls :func:`maybe_release_free_heap` before and after
each checkpointed block's forward and before its backward recompute. It trims only once the resident set has
grown by :data:`RELEASE_THRESHOLD_BYTES` since the last trim (and before the step's first recompute, whatever
the growth: :func:`release_before_recompute`), which keeps the RSS flat without
re-faulting the same pages at every block, and at most :data:`MAX_TRIMS_PER_STEP` times per forward
pass, a training step's (:func:`start_step`, which the lowest block calls). The state is per process, as the heap is.

glibc also serves an allocation above its mmap threshold from pages of its own, returned to the OS
when freed, but it raises that threshold to the size of each such block freed (up to 32 MiB), so
after the first step a block's activations and decompressed weights come from the heap, where their
freed pages stay resident between trims. :func:`map_large_allocations` (``MeBPConfig.map_large_allocations``)
fixes the threshold at :data:`MMAP_THRESHOLD_BYTES` (``mallopt(M_MMAP_THRESHOLD)``) for the whole
process and for good: glibc then never adapts it again, and has no call that would turn adapting back
on. It applies to the allocations the heap's free space cannot serve, so it must be set before the
heap has grown (docs/mebp.md, "Memory").

Both act on glibc's malloc only: where the process's ``malloc`` is another allocator (macOS, musl,
Windows, a preloaded jemalloc or tcmalloc) trimming is skipped and :func:`map_large_allocations` warns
that it has no effect.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from typing import Any, Callable

from lcsb_lightning.rank_zero import rank_zero_warn

#: Growth of the resident set since the last trim that triggers the next one.
RELEASE_THRESHOLD_BYTES = 16 << 20
#: Most trims per training step, a backstop behind the growth threshold (the 0.5B shape trims 49 times:
#: before each of its 24 blocks and recomputes, and before the loss).
MAX_TRIMS_PER_STEP = 128
#: Allocations at least this large get pages of their own, returned to the OS when freed.
MMAP_THRESHOLD_BYTES = 256 << 10
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_lock = threading.Lock()
_rss_after_last_trim = 0
_trims_this_step = 0
_backward_trimmed = False


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name is not None else None
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _foreign_malloc() -> str | None:
    """Why the process's ``malloc`` is not glibc's (None where it is)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return "the C library is not glibc"
    try:
        process_malloc = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    except (OSError, AttributeError, TypeError):  # no dlopen(NULL) (Windows)
        return None
    if process_malloc != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return "another allocator replaces glibc's malloc (LD_PRELOAD: jemalloc, tcmalloc, ...)"
    return None


@functools.lru_cache(maxsize=None)
def _glibc(function: str) -> Callable[..., Any] | None:
    """``function`` of glibc's malloc, where it is the process's allocator."""
    libc = _libc()
    return getattr(libc, function) if libc is not None and _foreign_malloc() is None else None


def _malloc_trim() -> Callable[[int], Any] | None:
    return _glibc("malloc_trim")


@functools.lru_cache(maxsize=1)
def map_large_allocations() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (once per process, for good);
    whether it could. Where it cannot, warns that ``map_large_allocations`` has no effect."""
    mallopt = _glibc("mallopt")
    done = mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    if not done:
        reason = _foreign_malloc() or "mallopt(M_MMAP_THRESHOLD) refused the value"
        rank_zero_warn(f"`map_large_allocations=True` has no effect here: {reason}. The peak is as without it.")
    return done


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


def start_step() -> None:
    """Start a forward pass's count of trims (the lowest block's ``BlockCheckpoint`` calls it at each call)."""
    global _trims_this_step, _backward_trimmed
    _trims_this_step = 0
    _backward_trimmed = False


def release_before_recompute() -> bool:
    """:func:`maybe_release_free_heap` before a backward recompute, the step's first one whatever the growth;
    returns whether it trimmed. What the forward and the loss freed then leaves before the backward's peak:
    under the growth threshold alone up to :data:`RELEASE_THRESHOLD_BYTES` of it stayed, depending on how many
    fresh pages the loss happened to touch."""
    global _backward_trimmed
    with _lock:
        first, _backward_trimmed = not _backward_trimmed, True
    return maybe_release_free_heap(threshold=0 if first else None)


def trims_this_step() -> int:
    """How many times :func:`maybe_release_free_heap` trimmed since :func:`start_step`."""
    return _trims_this_step


def maybe_release_free_heap(threshold: int | None = None, max_trims: int | None = None) -> bool:
    """:func:`release_free_heap` if the resident set grew by ``threshold`` bytes since the last trim
    (always, where the resident set cannot be read) and this step trimmed fewer than ``max_trims``
    times (defaults: :data:`RELEASE_THRESHOLD_BYTES`, :data:`MAX_TRIMS_PER_STEP`); returns whether it trimmed."""
    global _trims_this_step
    threshold = RELEASE_THRESHOLD_BYTES if threshold is None else threshold
    max_trims = MAX_TRIMS_PER_STEP if max_trims is None else max_trims
    if _malloc_trim() is None:
        return False
    with _lock:
        if _trims_this_step >= max_trims:
            return False
        rss = resident_bytes()
        if rss is not None and rss - _rss_after_last_trim < threshold:
            return False
        release_free_heap()
        _trims_this_step += 1
        return True
