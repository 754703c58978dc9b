"""Run outputs written atomically: the LoRA adapter, ``summary.json``, checkpoints; the loss curve."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from torch import nn


def _hidden_beside(path: Path, create: Callable[[Path], Any]) -> tuple[Path, Any]:
    """A new hidden path beside ``path`` (a rename onto ``path`` is then atomic) and what ``create`` made of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fresh = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return fresh, create(fresh)
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A new file beside ``path``, fsynced and renamed onto it once written: ``path`` is never half-written, and a
    failed write leaves the previous file intact. It gets the umask's permissions, not ``mkstemp``'s ``0o600``:
    a run's outputs are shared or copied. ``handle.name`` is the new file's path."""
    encoding = {} if "b" in mode else {"encoding": "utf-8"}
    tmp, handle = _hidden_beside(path, lambda fresh: open(fresh, mode.replace("w", "x"), **encoding))
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path) as handle:
        handle.write(text)
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

    The adapter is written into a new hidden folder beside ``path`` that then takes its place
    (:func:`replace_folder`): an interrupted save leaves the previous adapter in place.

    Args:
        model: A ``peft.PeftModel``.

    Raises:
        TypeError: not a peft model.
        ValueError: a trainable tensor is not finite (nothing is written).
    """
    if not hasattr(model, "peft_config"):
        raise TypeError(f"expected a peft model with an adapter, got {type(model).__name__}")
    _check_finite(model)
    fresh, _ = _hidden_beside(path, Path.mkdir)  # 0o777 less the umask, where tempfile.mkdtemp would give 0o700
    try:
        model.save_pretrained(str(fresh))
        file_mode = stat.S_IMODE(fresh.stat().st_mode) & 0o666  # a new folder's permissions are the umask's
        for written in fresh.rglob("*"):
            if written.is_file():
                written.chmod(file_mode)  # safetensors writes its files 0o600
        replace_folder(fresh, path)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    return path


def replace_folder(fresh: Path, path: Path) -> None:
    """Move the complete folder ``fresh`` to ``path`` (a sibling), replacing what ``path`` holds.

    A rename cannot replace a folder that has files (``ENOTEMPTY``), so the previous folder is renamed aside,
    ``fresh`` renamed in (the previous one renamed back if that fails), and only then the previous one removed:
    ``path`` is never a partly written or partly removed folder. A symbolic link at ``path`` (the adapter
    folders of 0.9) is replaced the same way, and the hidden folder it points to removed.
    """
    if not os.path.lexists(path):
        os.rename(fresh, path)
        return
    aside = path.parent / f".{path.name}.{secrets.token_hex(4)}.old"
    os.rename(path, aside)  # moves a link itself, not its target
    try:
        os.rename(fresh, path)
    except BaseException:
        os.rename(aside, path)
        raise
    if aside.is_symlink():
        target = (path.parent / os.readlink(aside)).resolve()
        aside.unlink()
        if target.parent == path.parent.resolve() and target.name.startswith(f".{path.name}-"):
            shutil.rmtree(target, ignore_errors=True)
    elif aside.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink()
