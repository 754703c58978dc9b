"""``HeapTrim``: the heap trims between a run's steps, for a float or a compressed model (Lightning glue over
:mod:`lcsb_lightning.mebp._internal.heap`, which owns every trim and counts it)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from lcsb_lightning.mebp._internal.heap import trim_heap


class HeapTrim(Callback):
    """Returns freed heap memory to the OS after every training batch and around every evaluation (glibc's
    ``malloc_trim``; a no-op elsewhere).

    glibc keeps the pages a step frees for reuse, and with several threads allocating they pile up step after
    step: the float main job's anonymous memory grew by 300 MB a step in its first steps without trims. Inside a
    step the blocks' own wrappers trim (``QuantizedMeBP(release_heap=True)`` for a compressed model,
    :func:`~lcsb_lightning.recompute.recompute_lower_blocks` for a float one). ``QuantizedMeBP`` logs the trims
    of each step, these included, as ``mebp/heap_trims``. Nothing else changes: no allocator setting, no tensor.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[HeapTrim()], logger=False)
    """

    def _trim(self, *_: Any) -> None:
        trim_heap()

    on_train_batch_end = _trim
    on_validation_start = _trim
    on_validation_end = _trim
