"""The one owner of heap trimming (glibc's ``malloc_trim``; a no-op with other allocators), for compressed and
float models alike: every trim goes through here, under one lock, counted, and resets the baseline the next
growth is measured from. Why the resident set needs it, and what it costs: docs/mebp.md, "Memory".
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
#: Most growth-gated trims per forward pass, a backstop behind the growth threshold (the 0.5B shape trims 49).
MAX_TRIMS_PER_PASS = 128
#: Allocations at least this large get pages of their own, returned to the OS when freed.
MMAP_THRESHOLD_BYTES = 256 << 10
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_lock = threading.Lock()
_rss_after_last_trim = 0
_trims = 0  # every trim since the process started
_gated_trims_this_pass = 0
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
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES`, once per process and for good (glibc has no
    call that turns its adaptive threshold back on): allocations the heap's free space cannot serve then get
    pages of their own, returned when freed. Whether it could; warns where it cannot."""
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


def trim_count() -> int:
    """How many trims this process made (all three calls); a step's trims are the difference over it."""
    return _trims


def _trim_locked() -> None:
    global _rss_after_last_trim, _trims
    _malloc_trim()(0)  # type: ignore[misc]
    _rss_after_last_trim = resident_bytes() or 0
    _trims += 1


def trim_heap() -> bool:
    """Return the free pages of every malloc arena to the OS now, whatever the growth (at fixed points:
    after loading, around evaluations: :class:`~lcsb_lightning.heap_trim.HeapTrim`); whether it could."""
    if _malloc_trim() is None:
        return False
    with _lock:
        _trim_locked()
    return True


def start_forward_pass() -> None:
    """Start a forward pass: its cap on growth-gated trims, and its first recompute's trim (the lowest block's
    wrapper calls it at each call, with or without gradients, also where LCSB cuts the block)."""
    global _gated_trims_this_pass, _backward_trimmed
    with _lock:
        _gated_trims_this_pass, _backward_trimmed = 0, False


def trim_heap_if_grown(threshold: int | None = None) -> bool:
    """Trim (around the blocks) if the resident set grew by ``threshold`` bytes (:data:`RELEASE_THRESHOLD_BYTES`)
    since the last trim (or cannot be read) and this pass trimmed fewer than :data:`MAX_TRIMS_PER_PASS` times."""
    global _gated_trims_this_pass
    threshold = RELEASE_THRESHOLD_BYTES if threshold is None else threshold
    if _malloc_trim() is None:
        return False
    with _lock:
        if _gated_trims_this_pass >= MAX_TRIMS_PER_PASS:
            return False
        rss = resident_bytes()
        if rss is not None and rss - _rss_after_last_trim < threshold:
            return False
        _trim_locked()
        _gated_trims_this_pass += 1
        return True


def trim_heap_before_backward() -> bool:
    """:func:`trim_heap_if_grown` before a backward recompute, the pass's first one whatever the growth, so that
    what the forward and the loss freed leaves before the backward's peak."""
    global _backward_trimmed
    with _lock:
        first, _backward_trimmed = not _backward_trimmed, True
    return trim_heap_if_grown(threshold=0 if first else None)
