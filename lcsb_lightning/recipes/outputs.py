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


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename: ``path`` is never half-written,
    and an interrupted write leaves the previous file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: Path, data: Any) -> Path:
    """Write JSON to ``path`` atomically (see :func:`atomic_write_text`); non-serialisable values as ``str``."""
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


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


def _check_finite(model: nn.Module) -> None:
    bad = [name for name, p in model.named_parameters() if p.requires_grad and not bool(p.detach().isfinite().all())]
    if bad:
        raise ValueError(
            f"refusing to save an adapter with non-finite values in {len(bad)} tensors (e.g. {', '.join(bad[:3])}); "
            "the run diverged: lower module.lr or keep the divergence guard on (guard.action=skip|rollback|stop)"
        )


def save_adapter(model: nn.Module, path: Path) -> Path:
    """Save a peft model's adapter (``save_pretrained``) so that ``path`` always holds a complete adapter.

    ``path`` is a symbolic link to a sibling folder ``.<name>-<n>``: the new adapter is written into a
    new folder, then the link is replaced in one atomic rename, then the previous folder is removed.
    An interrupted save leaves the previous adapter in place; ``PeftModel.from_pretrained(path)``
    follows the link.

    Args:
        model: A ``peft.PeftModel``.
        path: The adapter's path (an existing real folder there is replaced the same way).

    Raises:
        TypeError: not a peft model.
        ValueError: a trainable tensor is not finite (nothing is written).
    """
    if not hasattr(model, "peft_config"):
        raise TypeError(f"expected a peft model with an adapter, got {type(model).__name__}")
    _check_finite(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    link = path.parent / f".{path.name}.link-{target.name}"
    previous = path.resolve() if path.is_symlink() else None
    try:
        model.save_pretrained(str(target))
        os.symlink(target.name, link)
        if path.exists() and not path.is_symlink():  # a real folder from an older version: set it aside first
            aside = path.parent / f".{path.name}-replaced-{target.name}"
            os.replace(path, aside)
            previous = aside
        os.replace(link, path)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        link.unlink(missing_ok=True)
        raise
    if previous is not None and previous != target:
        shutil.rmtree(previous, ignore_errors=True)
    return path
