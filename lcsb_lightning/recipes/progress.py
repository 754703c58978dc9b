"""A rich progress bar that shows the loss, the step time and LCSB's selected blocks."""

from __future__ import annotations

import time
from typing import Any

from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, RichProgressBar


def _format_blocks(selection: tuple[int, ...], limit: int = 8) -> str:
    if not selection:
        return "-"
    shown = ",".join(str(i) for i in selection[:limit])
    return shown + ("..." if len(selection) > limit else "")


class StepTimer(Callback):
    """Measures the wall time of every training batch (forward, backward and optimizer step)."""

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self.recent: list[float] = []
        self.total_seconds = 0.0
        self._t0: float | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is not None:
            dt = time.perf_counter() - self._t0
            self.total_seconds += dt
            self.recent = (self.recent + [dt])[-self.window :]
            self._t0 = None


class LCSBProgressBar(RichProgressBar):
    """``RichProgressBar`` that adds ``step_ms`` (from a :class:`StepTimer`) and LCSB's selected ``blocks``."""

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """Lightning's progress-bar metrics plus ``step_ms`` and ``blocks``."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        for cb in trainer.callbacks:
            if isinstance(cb, StepTimer) and cb.recent:
                items["step_ms"] = f"{1000 * sum(cb.recent) / len(cb.recent):.0f}"
            selection = getattr(cb, "selection", None)
            if isinstance(selection, tuple):
                items["blocks"] = _format_blocks(selection)
        return items
