"""``HeapTrim``: heap trims between a run's steps (Lightning glue over :mod:`lcsb_lightning.mebp._internal.heap`)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from lcsb_lightning.mebp._internal.heap import trim_heap


class HeapTrim(Callback):
    """Returns freed heap memory to the OS after every training batch and around every evaluation (glibc's
    ``malloc_trim``; a no-op elsewhere): with several threads allocating, the pages a step frees pile up (the float
    main job grew by 300 MB a step without trims). ``QuantizedMeBP`` logs the trims as ``mebp/heap_trims``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[HeapTrim()], logger=False)
    """

    def _trim(self, *_: Any) -> None:
        trim_heap()

    on_train_batch_end = _trim
    on_validation_start = _trim
    on_validation_end = _trim
