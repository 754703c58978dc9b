"""A rich progress bar that shows the loss, the step time and LCSB's selected blocks."""

from __future__ import annotations

import time
from typing import Any

from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar


def _format_blocks(selection: tuple[int, ...], limit: int = 8) -> str:
    if not selection:
        return "-"
    shown = ",".join(str(i) for i in selection[:limit])
    return shown + ("..." if len(selection) > limit else "")


class LCSBProgressBar(RichProgressBar):
    """``RichProgressBar`` that adds ``step_ms`` (mean of the last optimizer steps) and ``blocks``."""

    def __init__(self, window: int = 10, **kwargs: Any):
        super().__init__(**kwargs)
        self.window = window
        self._times: list[float] = []
        self._t0: float | None = None
        self.total_train_seconds = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is not None:
            dt = time.perf_counter() - self._t0
            self.total_train_seconds += dt
            self._times = (self._times + [dt])[-self.window :]
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """Lightning's progress-bar metrics plus ``step_ms`` and ``blocks``."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        if self._times:
            items["step_ms"] = f"{1000 * sum(self._times) / len(self._times):.0f}"
        for cb in trainer.callbacks:
            selection = getattr(cb, "selection", None)
            if isinstance(selection, tuple):
                items["blocks"] = _format_blocks(selection)
                break
        return items
