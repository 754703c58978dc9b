"""PNG figures of the benchmark (matplotlib, Agg backend): loss curves, speed and memory bars,
the block-selection heatmap and the divergence grid."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 80


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc = (acc + [v])[-window:]
        out.append(sum(acc) / len(acc))
    return out


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def loss_curves(results: Sequence[Mapping[str, Any]], path: Path, window: int = 5) -> Path:
    """Training loss (moving average) and eval loss per arm, by step and by train wall-clock, one row per task."""
    tasks = list(dict.fromkeys(r["labels"]["task"] for r in results))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.2 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        for r in (r for r in results if r["labels"]["task"] == task):
            c = r["curves"]
            arm = r["labels"]["arm"]
            smooth = _smooth(c["train_loss"], window)
            line = axes[row][0].plot(c["steps"], smooth, label=arm, lw=1.2)[0]
            axes[row][1].plot(c["train_seconds"], smooth, label=arm, lw=1.2, color=line.get_color())
            evals = sorted((int(s), m["val/loss"]) for s, m in r["eval_at_steps"].items() if m and "val/loss" in m)
            axes[row][0].plot([s for s, _ in evals], [v for _, v in evals], "o--", ms=3, lw=0.8, color=line.get_color())
            timed = [e for e in [*c.get("evals", []), r.get("eval_at_budget")] if e and "val/loss" in e.get("metrics", {})]
            axes[row][1].plot([e["train_seconds"] for e in timed], [e["metrics"]["val/loss"] for e in timed], "o",
                              ms=4, color=line.get_color())
        axes[row][0].set(title=f"{task}: train loss (avg {window}) and eval loss (dots) by step", xlabel="step", ylabel="loss")
        axes[row][1].set(title=f"{task}: train loss and eval loss (dots) by train wall-clock", xlabel="seconds", ylabel="loss")
        axes[row][0].legend(fontsize=7)
    return _save(fig, path)


def speed_bars(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Step time and peak RSS bars per shape and arm."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        xs = [j + i * width for j in range(len(shapes))]
        by_shape = {r["shape"]: r for r in rows if r["arm"] == arm}
        axes[0].bar(xs, [by_shape.get(s, {}).get("median_s") or 0 for s in shapes], width, label=arm)
        axes[1].bar(xs, [by_shape.get(s, {}).get("peak_rss_mb") or 0 for s in shapes], width, label=arm)
    for ax, title in zip(axes, ("median step time (s)", "whole-process peak RSS (MiB)")):
        ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(shapes))], shapes, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7)
    return _save(fig, path)


def selection_heatmap(results: Sequence[Mapping[str, Any]], path: Path, max_steps: int = 120) -> Path:
    """Which blocks trained at each step (blocks x steps), one panel per arm of the first task."""
    task = results[0]["labels"]["task"]
    chosen = [r for r in results if r["labels"]["task"] == task and r["curves"]["selections"]]
    fig, axes = plt.subplots(1, len(chosen), figsize=(2.4 * len(chosen) + 1, 3.2), squeeze=False)
    for ax, r in zip(axes[0], chosen):
        sel = r["curves"]["selections"][:max_steps]
        n = int(r["summary"].get("num_blocks") or 1 + max((max(s) for s in sel if s), default=0))
        grid = [[0.0] * len(sel) for _ in range(n)]
        for step, blocks in enumerate(sel):
            for b in blocks:
                grid[b][step] = 1.0
        ax.imshow(grid, aspect="auto", cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest", origin="lower")
        ax.set(title=r["labels"]["arm"], xlabel="step", ylabel="block")
        ax.title.set_fontsize(8)
    return _save(fig, path)


def divergence_grid(grid: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Diverged runs / runs per (format, arm) row and learning-rate column."""
    rows = list(dict.fromkeys((c["fmt"], c["arm"]) for c in grid))
    lrs = sorted({c["lr"] for c in grid})
    cell = {(c["fmt"], c["arm"], c["lr"]): c for c in grid}
    frac = [[(cell[(f, a, lr)]["diverged"] / cell[(f, a, lr)]["runs"]) if (f, a, lr) in cell else 0.0 for lr in lrs]
            for f, a in rows]
    fig, ax = plt.subplots(figsize=(1.6 * len(lrs) + 2.5, 0.55 * len(rows) + 1.5))
    ax.imshow(frac, cmap="Reds", vmin=0, vmax=1, aspect="auto")
    for i, (f, a) in enumerate(rows):
        for j, lr in enumerate(lrs):
            c = cell.get((f, a, lr))
            ax.text(j, i, f"{c['diverged']}/{c['runs']}" if c else "-", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_yticks(range(len(rows)), [f"{f} {a}" for f, a in rows])
    ax.set(title="diverged runs / runs", xlabel="learning rate")
    return _save(fig, path)
