"""Run outputs: the LoRA adapter folders (replaced atomically) and the loss curve."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path

from torch import nn

from lcsb_lightning.atomic_files import hidden_path_beside


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
    fresh, _ = hidden_path_beside(path, Path.mkdir)  # 0o777 less the umask, where tempfile.mkdtemp would give 0o700
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
