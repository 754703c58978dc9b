"""Run outputs written atomically: the LoRA adapter, ``summary.json``, and process memory figures."""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn


def peak_rss_mb() -> float:
    """Whole-process peak resident set size in MiB (``ru_maxrss``; KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def atomic_write_json(path: Path, data: Any) -> Path:
    """Write JSON to ``path`` through a temporary file and a rename, so no half-written file remains.

    Args:
        path: Destination.
        data: JSON-serialisable object (non-serialisable values are written with ``str``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _logged_series(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``train/loss`` and ``val/loss`` as (step, value) pairs from TensorBoard events or a CSV log."""
    series: dict[str, list[tuple[int, float]]] = {"train/loss": [], "val/loss": []}
    events = sorted(log_dir.glob("events.out.tfevents.*"))
    if events:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        for path in events:
            acc = EventAccumulator(str(path)).Reload()
            for tag in series:
                if tag in acc.Tags()["scalars"]:
                    series[tag] += [(e.step, e.value) for e in acc.Scalars(tag)]
    elif (log_dir / "metrics.csv").is_file():
        import csv

        with (log_dir / "metrics.csv").open() as handle:
            for row in csv.DictReader(handle):
                for tag in series:
                    if row.get(tag):
                        series[tag].append((int(row["step"]), float(row[tag])))
    return series


def write_loss_curve(log_dir: str | Path, path: Path) -> Path | None:
    """A PNG of the training loss and the eval loss by step, read from the run's logs (None without any)."""
    series = _logged_series(Path(log_dir))
    if not series["train/loss"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for tag, style in (("train/loss", "-"), ("val/loss", "o-")):
        points = sorted(series[tag])
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], style, label=tag, lw=1.2, ms=4)
    ax.set(xlabel="optimizer step", ylabel="loss", title="loss by step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def save_adapter(model: nn.Module, path: Path) -> Path:
    """Save a peft model's adapter (``save_pretrained``) atomically into the folder ``path``.

    Args:
        model: A ``peft.PeftModel``.
        path: Destination folder; an existing one is replaced.
    """
    if not hasattr(model, "peft_config"):
        raise TypeError(f"expected a peft model with an adapter, got {type(model).__name__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(str(tmp))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
