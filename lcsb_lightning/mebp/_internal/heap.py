"""Give freed heap memory back to the OS (glibc's ``malloc_trim``; a no-op with other allocators): the one owner
of heap trimming, for compressed and float models alike.

glibc keeps freed memory in its heaps for reuse. A training step allocates its activations,
gradients and temporaries among longer-lived tensors, so the freed pages stay resident: with the
allocator's defaults the RSS of a Qwen2.5-0.5B-shape MeBP run grew from 1.5 GB to over 2 GB in four
steps. Every trim of the library goes through this module, under its lock, counted (:func:`trim_count`), and
sets the baseline that the next growth is measured from. Three calls, one per kind of moment:

* :func:`trim_heap`: now, whatever the growth; at fixed points outside the blocks (after loading, after each
  training batch and around evaluations: :class:`~lcsb_lightning.heap_trim.HeapTrim`).
* :func:`trim_heap_if_grown`: before and after each block's forward with gradients (the per-block wrapper that
  ``QuantizedMeBP(release_heap=True)`` and :func:`~lcsb_lightning.recompute.recompute_lower_blocks` install),
  once the resident set has grown by :data:`RELEASE_THRESHOLD_BYTES` since the last trim, which keeps the RSS
  flat without re-faulting the same pages at every block, and at most :data:`MAX_TRIMS_PER_PASS` times per
  forward pass (:func:`start_forward_pass`, which the lowest block's wrapper calls).
* :func:`trim_heap_before_backward`: before each backward recompute; the pass's first one trims whatever the
  growth, so what the forward and the loss freed leaves before the backward's peak.

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
#: Most growth-gated trims per forward pass, a backstop behind the growth threshold (the 0.5B shape trims 49
#: times a step: before each of its 24 blocks and recomputes, and before the loss).
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


def trim_count() -> int:
    """How many trims this process made (all three calls); a step's trims are the difference over it."""
    return _trims


def _trim_locked() -> None:
    global _rss_after_last_trim, _trims
    _malloc_trim()(0)  # type: ignore[misc]
    _rss_after_last_trim = resident_bytes() or 0
    _trims += 1


def trim_heap() -> bool:
    """Return the free pages of every malloc arena to the OS now; whether it could (glibc only)."""
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
    """Trim if the resident set grew by ``threshold`` bytes (default :data:`RELEASE_THRESHOLD_BYTES`) since the
    last trim (always, where the resident set cannot be read) and this forward pass trimmed fewer than
    :data:`MAX_TRIMS_PER_PASS` times; returns whether it trimmed."""
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
    """:func:`trim_heap_if_grown` before a backward recompute, the pass's first one whatever the growth;
    returns whether it trimmed. Under the growth threshold alone up to :data:`RELEASE_THRESHOLD_BYTES` of what
    the forward and the loss freed stayed through the backward's peak, depending on how many fresh pages the
    loss happened to touch."""
    global _backward_trimmed
    with _lock:
        first, _backward_trimmed = not _backward_trimmed, True
    return trim_heap_if_grown(threshold=0 if first else None)
