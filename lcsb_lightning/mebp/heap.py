"""Give freed heap memory back to the OS (glibc's ``malloc_trim``; a no-op with other allocators).

glibc keeps freed memory in its heaps for reuse; the activations, gradients and temporaries of a
training step are allocated among longer-lived tensors, so the freed pages stay resident and the
RSS grows from step to step. ``QuantizedMeBP(release_heap=True)`` calls :func:`release_free_heap`
before each checkpointed block runs (forward and backward recompute): the resident set stays flat,
for the time the kernel then takes to fault those pages in again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, Callable


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], Any] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def heap_release_supported() -> bool:
    """Whether this process's allocator can be asked to return freed memory (glibc)."""
    return _malloc_trim() is not None


def release_free_heap() -> None:
    """Return the free pages of every malloc arena to the OS; a no-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
