"""PNG figures of the benchmark (matplotlib, Agg backend): loss curves, memory bars,
the block-selection heatmap and the divergence grid."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lcsb_lightning.bench.time_to_quality import StepTime, elapsed  # noqa: E402

DPI = 80


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _label(r: Mapping[str, Any]) -> str:
    lab = r["labels"]
    return lab["arm"] + (" (equal wall-clock)" if lab.get("run") == "wallclock" else "")


def loss_curves(results: Sequence[Mapping[str, Any]], step_seconds: Mapping[tuple[str, str], StepTime], path: Path,
                targets: Mapping[str, float] | None = None) -> Path:
    """Eval loss by step and by training wall-clock, one row per task, with each task's time-to-quality
    target (``targets``: task -> eval loss) as a dotted line.

    The wall-clock of step ``s`` is ``s`` times the arm's step time in the recipe loop (the
    recipe_speed study, measured with the arms alternating), or the run's own train time without it.
    """
    tasks = list(dict.fromkeys(r["labels"]["task"] for r in results))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.4 * len(tasks)), squeeze=False)
    colors: dict[str, Any] = {}
    for row, task in enumerate(tasks):
        for r in (r for r in results if r["labels"]["task"] == task):
            arm = r["labels"]["arm"]
            evals = sorted((int(s), m["val/loss"]) for s, m in r["eval_at_steps"].items() if m and "val/loss" in m)
            style = "o--" if r["labels"].get("run") == "wallclock" else "o-"
            line = axes[row][0].plot([s for s, _ in evals], [v for _, v in evals], style, ms=3, lw=1.1,
                                     label=_label(r), color=colors.get(arm))[0]
            colors.setdefault(arm, line.get_color())
            per_step = step_seconds.get((task, arm))
            if per_step is not None:
                seconds = [elapsed(per_step, s) for s, _ in evals]
            else:
                timed = dict(zip(r["curves"]["steps"], r["curves"]["train_seconds"]))
                seconds = [timed.get(s, 0.0) for s, _ in evals]
            axes[row][1].plot(seconds, [v for _, v in evals], style, ms=3, lw=1.1, color=colors[arm], label=_label(r))
        target = (targets or {}).get(task)
        if target is not None:
            for axis in axes[row]:
                axis.axhline(target, color="grey", ls=":", lw=1, label="time-to-quality target")
        axes[row][0].set(title=f"{task}: eval loss by step", xlabel="optimizer step", ylabel="eval loss")
        axes[row][1].set(title=f"{task}: eval loss by training wall-clock", xlabel="seconds", ylabel="eval loss")
        axes[row][0].legend(fontsize=7)
    return _save(fig, path)


def alignment(results: Sequence[Mapping[str, Any]], path: Path, groups: int = 4) -> Path:
    """Mean cosine of the used vs exact gradient per depth group, over training, one panel per probed arm."""
    from lcsb_lightning.bench.report import block_groups

    probed = [r for r in results if r["curves"].get("probes") and r["labels"].get("run", "steps") == "steps"]
    fig, axes = plt.subplots(1, len(probed), figsize=(2.8 * len(probed) + 1, 3.0), squeeze=False)
    for ax, r in zip(axes[0], probed):
        n = int(r["summary"].get("num_blocks") or 1)
        for g, blocks in enumerate(block_groups(n, groups)):
            points = [(p["step"], sum(p["cosine"][str(b)] for b in blocks if str(b) in p["cosine"]) /
                       sum(str(b) in p["cosine"] for b in blocks))
                      for p in r["curves"]["probes"] if any(str(b) in p["cosine"] for b in blocks)]
            if points:
                ax.plot([s for s, _ in points], [c for _, c in points], "o-", ms=3, lw=1, label=f"blocks {blocks[0]}-{blocks[-1]}")
        ax.axhline(0.0, color="grey", lw=0.6)
        ax.set(title=f"{r['labels']['task']}: {r['labels']['arm']}", xlabel="step", ylabel="cosine(used, exact)", ylim=(-1.05, 1.05))
        ax.title.set_fontsize(8)
        ax.legend(fontsize=6)
    return _save(fig, path)


def phase_bars(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Stacked step time per phase, per task and arm (recipe loop)."""
    from lcsb_lightning.bench.recipe_speed import PHASES as phases
    labels = [f"{r['task']}\n{r['arm']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 3.8))
    bottom = [0.0] * len(rows)
    for phase in phases:
        values = [r["phases"].get(phase, 0.0) for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(ylabel="seconds per step", title="recipe-loop step time by phase")
    ax.legend(fontsize=7)
    return _save(fig, path)


def memory_bars(memory: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Peak anonymous memory above imports per shape (and sequence length) and config (memory study); a config
    trained with another optimizer than AdamW is its own series (``lean sgd``)."""

    def series(row: Mapping[str, Any]) -> str:
        optimizer = row.get("optimizer", "adamw")
        return row["config"] if optimizer == "adamw" else f"{row['config']} {optimizer}"

    fig, ax = plt.subplots(figsize=(6, 3.6))
    shapes = list(dict.fromkeys(f"{r['shape']} {r['seq_len']}" for r in memory))
    configs = list(dict.fromkeys(series(r) for r in memory))
    width = 0.8 / max(1, len(configs))
    for i, config in enumerate(configs):
        by_shape = {f"{r['shape']} {r['seq_len']}": r for r in memory if series(r) == config}
        ax.bar([j + i * width for j in range(len(shapes))],
               [by_shape.get(s, {}).get("peak_anon_train_mb") or 0 for s in shapes], width, label=config)
    ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(shapes))], shapes, fontsize=8)
    ax.set_title("peak anonymous memory above imports (MB)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def selection_heatmap(results: Sequence[Mapping[str, Any]], path: Path, max_steps: int = 120) -> Path:
    """Which blocks trained at each step (blocks x steps), one panel per equal-steps arm of the first task."""
    task = results[0]["labels"]["task"]
    chosen = [r for r in results if r["labels"]["task"] == task and r["curves"]["selections"]
              and r["labels"].get("run", "steps") == "steps"]
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


def cost_constant(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """The constant ``a`` of the step-cost model against the parameter count (log scale), one line per
    pipeline, the bars spanning the per-round fits."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for pipeline in dict.fromkeys(r["pipeline"] for r in rows):
        mine = sorted((r for r in rows if r["pipeline"] == pipeline), key=lambda r: r["params"])
        xs, ys = [r["params"] for r in mine], [r["a"] for r in mine]
        err = [[y - r["a_min"] for y, r in zip(ys, mine)], [r["a_max"] - y for y, r in zip(ys, mine)]]
        ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=pipeline)
        for x, y, r in zip(xs, ys, mine):
            ax.annotate(r["shape"], (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log")
    ax.set(xlabel="parameters", ylabel="a (share of full backprop's step)", title="step cost a + b·d: the constant a")
    ax.legend(fontsize=7)
    return _save(fig, path)
