"""What a run shows while and after it trains: the progress bar with LCSB's blocks, the train-time timer, the
closing table."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, RichProgressBar


def _format_blocks(selection: tuple[int, ...], limit: int = 8) -> str:
    if not selection:
        return "-"
    shown = ",".join(str(i) for i in selection[:limit])
    return shown + ("..." if len(selection) > limit else "")


class StepTimer(Callback):
    """Sums the wall time of the training batches, validation excluded (Lightning's ``Timer`` counts it, and
    ``ThroughputMonitor`` keeps its totals private)."""

    def __init__(self) -> None:
        self.total_seconds = 0.0
        self._t0: float | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is not None:
            self.total_seconds += time.perf_counter() - self._t0
            self._t0 = None


class LCSBProgressBar(RichProgressBar):
    """``RichProgressBar`` that adds LCSB's selected ``blocks`` (Rich already shows the step rate)."""

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """Lightning's progress-bar metrics plus ``blocks``."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        for cb in trainer.callbacks:
            selection = getattr(cb, "selection", None)
            if isinstance(selection, tuple):
                items["blocks"] = _format_blocks(selection)
        return items

    def _get_train_description(self, current_epoch: int) -> str:
        # Step-bounded runs have max_epochs == -1, which Rich's bar would print as "Epoch 0/-2".
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        return f"{'Training':{len(self.validation_description)}}"


def _memory_line(summary: dict[str, Any]) -> str:
    memory = summary.get("memory") or {}
    line = f"{summary.get('peak_rss_mb', 0):.0f} MiB whole process"
    if memory.get("peak_anon_above_imports_mib") is not None:
        line += (f", {memory['peak_anon_above_imports_mib']:.0f} MiB anonymous above the imports "
                 f"(after the imports: {memory['after_imports_rss_mib']:.0f} MiB, {memory['after_imports_anon_mib']:.0f} anonymous)")
    return line


def final_table(summary: dict[str, Any], loss_curve: Path | None) -> str:
    """The table printed at the end of ``lcsb-finetune``: initial vs final eval metrics, speed, memory, outputs."""
    initial, final = summary.get("initial_metrics") or {}, summary.get("final_metrics") or {}
    keys = [k for k in ("val/loss", "val/ppl", "val/token_acc", "val/accuracy", "val/exact_match") if k in final]
    width = max([len(k) for k in keys] + [len("peak memory")])
    lines = [f"{'metric':<{width}}  {'before':>10}  {'after':>10}"]
    for key in keys:
        before = f"{initial[key]:.4f}" if key in initial else "-"
        lines.append(f"{key:<{width}}  {before:>10}  {final[key]:>10.4f}")
    lines += [
        f"{'steps':<{width}}  {summary.get('steps')} ({summary.get('steps_per_second') or 0:.3f} steps/s of training)",
        f"{'peak memory':<{width}}  {_memory_line(summary)}",
        f"{'adapter':<{width}}  {summary.get('adapter_dir')}",
    ]
    best = summary.get("best")
    if best:
        lines.append(f"{'best':<{width}}  {best['monitor']} {best['value']:.4f} at step {best['step']}: {best['adapter_dir']}")
    lines.append(f"{'logs':<{width}}  {summary.get('log_dir')}  (tensorboard --logdir {summary.get('log_dir')})")
    if loss_curve is not None:
        lines.append(f"{'loss curve':<{width}}  {loss_curve}")
    return "\n".join(lines)

