"""Tables of the benchmark (pure functions of the arms' results) and the ``results.md``/``results.json`` writers."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lcsb_lightning.recipes.outputs import atomic_write_json

Row = dict[str, Any]
METRIC_KEYS = ("val/accuracy", "val/exact_match", "val/ppl")


def task_metric(metrics: Mapping[str, float] | None) -> tuple[str, float | None]:
    """The task's own metric: accuracy (classification), exact match (QA), else perplexity."""
    metrics = metrics or {}
    for key in METRIC_KEYS:
        if key in metrics:
            return key.removeprefix("val/"), metrics[key]
    return "-", None


def rel_change(value: float | None, base: float | None) -> float | None:
    """``100 * (value - base) / base`` (percent), None when either is missing or not finite."""
    if value is None or base is None or not math.isfinite(value) or not math.isfinite(base) or base == 0:
        return None
    return 100.0 * (value - base) / abs(base)


def _loss(metrics: Mapping[str, Any] | None) -> float | None:
    return None if not metrics else metrics.get("val/loss")


def _final_eval(r: Mapping[str, Any]) -> dict[str, Any]:
    """The final evaluation as the wall-clock point of an arm that hit its step cap before spending its
    budget (it used less time than the baseline, so the comparison still favours the baseline)."""
    summary, curves = r.get("summary") or {}, r.get("curves") or {}
    return {"step": summary.get("steps"), "train_seconds": curves.get("total_train_seconds"),
            "metrics": summary.get("final_metrics")}


def quality_rows(results: Sequence[Mapping[str, Any]]) -> list[Row]:
    """One row per quality arm: eval loss and metric at equal steps and at the baseline's wall-clock budget.

    ``degradation_pct`` compares eval loss at equal steps with the arm's baseline (the full-backprop
    arm it is paired with); ``wallclock_delta_pct`` compares the eval loss at the equal wall-clock
    budget with the baseline's final eval loss (negative: better than full backprop).
    """
    by_name = {r["name"]: r for r in results}
    rows: list[Row] = []
    for r in results:
        steps = str(r["equal_steps"])
        at_steps = r["eval_at_steps"].get(steps)
        base = by_name.get(r["baseline"] or r["name"])
        base_at_steps = base["eval_at_steps"].get(steps) if base else None
        budget = (r.get("eval_at_budget") or _final_eval(r)) if r.get("wallclock", True) else {}
        base_budget = (base or {}).get("eval_at_budget") or {}
        metric_name, metric = task_metric(at_steps)
        row: Row = {
            "task": r["labels"]["task"], "arm": r["labels"]["arm"], "baseline": (base or {}).get("labels", {}).get("arm"),
            "steps": int(steps), "initial_loss": _loss(r["eval_at_steps"].get("0")),
            "loss": _loss(at_steps), "metric_name": metric_name, "metric": metric,
            "initial_metric": task_metric(r["eval_at_steps"].get("0"))[1],
            "degradation_pct": rel_change(_loss(at_steps), _loss(base_at_steps)) if r["baseline"] else 0.0,
            "train_seconds": r.get("train_seconds_at_steps"),
            "steps_per_s": (r["summary"] or {}).get("steps_per_second"),
            "budget_seconds": budget.get("train_seconds"), "budget_step": budget.get("step"),
            "budget_loss": _loss(budget.get("metrics")), "budget_metric": task_metric(budget.get("metrics"))[1],
            "wallclock_delta_pct": rel_change(_loss(budget.get("metrics")), _loss(base_budget.get("metrics"))),
            "diverged": r.get("diverged"),
        }
        rows.append(row)
    return rows


def speed_rows(timing: Mapping[str, Mapping[str, Any]], memory: Sequence[Mapping[str, Any]]) -> list[Row]:
    """One row per shape x arm: median step time, steps/s, speed-up vs ``full`` and the Amdahl bound, peak RSS.

    The bound of an arm training k of N blocks is ``T_full / (T_fwd + (T_full - T_fwd) * k / N)``,
    from the same process's forward-only time.
    """
    mem = {(m["labels"]["shape"], m["labels"]["arm"]): m for m in memory}
    rows: list[Row] = []
    for shape, t in timing.items():
        arms = t["arms"]
        full = arms.get("full", {}).get("median_s")
        t_fwd, n = t.get("forward_median_s"), t.get("num_blocks") or 0
        for name, a in arms.items():
            k = a.get("k")
            bound = None
            if full and t_fwd is not None and k and n:
                bound = full / (t_fwd + (full - t_fwd) * k / n)
            m = mem.get((shape, name), {})
            rows.append({
                "shape": shape, "arm": name, "k": k, "num_blocks": n, "median_s": a["median_s"],
                "steps_per_s": a["steps_per_s"], "speedup": (full / a["median_s"]) if full else None,
                "amdahl_bound": bound, "peak_rss_mb": m.get("peak_rss_mb"),
                "peak_rss_after_load_mb": m.get("peak_rss_after_load_mb"),
                "loadavg": [t.get("loadavg_before"), t.get("loadavg_after")],
            })
    for (shape, name), m in mem.items():  # memory measured without a timing run
        if shape not in timing:
            rows.append({"shape": shape, "arm": name, "k": m.get("k"), "num_blocks": m.get("num_blocks"),
                         "peak_rss_mb": m.get("peak_rss_mb"), "peak_rss_after_load_mb": m.get("peak_rss_after_load_mb")})
    return rows


def stability_grid(results: Sequence[Mapping[str, Any]]) -> list[Row]:
    """Divergence counts per arm x format x learning rate (over seeds), with the reasons."""
    cells: dict[tuple[str, str, float], Row] = {}
    for r in results:
        lab = r["labels"]
        cell = cells.setdefault((lab["arm"], lab["fmt"], float(lab["lr"])), {
            "arm": lab["arm"], "fmt": lab["fmt"], "lr": float(lab["lr"]), "runs": 0, "diverged": 0,
            "reasons": [], "final_losses": [], "initial_losses": []})
        cell["runs"] += 1
        cell["diverged"] += int(bool(r["diverged"]))
        if r["diverged"]:
            cell["reasons"].append(f"seed {lab['seed']}: {r['divergence_reason']}")
        steps = str(r["equal_steps"])
        cell["final_losses"].append(_loss(r["eval_at_steps"].get(steps)))
        cell["initial_losses"].append(_loss(r["eval_at_steps"].get("0")))
    return sorted(cells.values(), key=lambda c: (c["fmt"], c["arm"], c["lr"]))


def only_full_diverges(grid: Sequence[Row]) -> list[str]:
    """Settings (format, lr) where full backprop diverged in some run and no LCSB run did."""
    out = []
    for cell in grid:
        if cell["arm"] == "full" and cell["diverged"]:
            others = [c for c in grid if c["fmt"] == cell["fmt"] and c["lr"] == cell["lr"] and c["arm"] != "full"]
            if others and not any(c["diverged"] for c in others):
                out.append(f"{cell['fmt']} lr={cell['lr']:g}")
    return out


def _f(value: Any, spec: str = ".3f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-" if value is None else str(value)
    return f"{value:{spec}}{suffix}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(tables: Mapping[str, Any], meta: Mapping[str, Any], plots: Sequence[str] = ()) -> str:
    """``results.md``: the speed, memory, quality and stability tables with the goals next to them."""
    out = [f"# LCSB benchmark: {meta.get('name', '')}", "",
           f"Command: `{meta.get('command', '')}`  ", f"Machine: {meta.get('machine', '')}  ",
           f"Date: {meta.get('date', '')}", ""]
    speed = tables.get("speed") or []
    if speed:
        out += ["## Speed and memory (QuantizedMeBP, LoRA, identity LCSB; medians, arms alternating in one process)", "",
                "Goal: LCSB cyclic k = N/4 at least 2x the steps/s of full backprop on every shape. Paper: up to 1.40x.", "",
                table(["shape", "arm", "k/N", "step (s)", "steps/s", "speed-up", "Amdahl bound", "peak RSS (MiB)"],
                      [[r["shape"], r["arm"], f"{r.get('k')}/{r.get('num_blocks')}", _f(r.get("median_s")),
                        _f(r.get("steps_per_s")), _f(r.get("speedup"), ".2f", "x"), _f(r.get("amdahl_bound"), ".2f", "x"),
                        _f(r.get("peak_rss_mb"), ".0f")] for r in speed]), ""]
        loads = {r["shape"]: r.get("loadavg") for r in speed if r.get("loadavg") and r["loadavg"][0]}
        out += [f"Load average (1, 5, 15 min) before -> after timing {shape}: "
                f"{', '.join(f'{x:.1f}' for x in la[0])} -> {', '.join(f'{x:.1f}' for x in la[1])}  " for shape, la in loads.items()]
        out.append("")
    quality = tables.get("quality") or []
    if quality:
        out += ["## Quality at equal steps", "",
                "Goal: final eval loss of LCSB k = N/4 within 2% of full backprop. Paper: < 2% degradation.", "",
                table(["task", "arm", "steps", "eval loss (start -> end)", "metric (start -> end)", "vs baseline"],
                      [[r["task"], r["arm"], str(r["steps"]), f"{_f(r['initial_loss'])} -> {_f(r['loss'])}",
                        f"{r['metric_name']} {_f(r['initial_metric'])} -> {_f(r['metric'])}",
                        "baseline" if r["baseline"] == r["arm"] else f"{_f(r['degradation_pct'], '+.2f', '%')} vs {r['baseline']}"]
                       for r in quality]), "",
                "## Quality at equal wall-clock (each arm trains until it has spent the baseline's train time, or hits its step cap)", "",
                "Goal: LCSB at or below full backprop.", "",
                table(["task", "arm", "train time (s)", "steps", "eval loss", "metric", "vs baseline"],
                      [[r["task"], r["arm"], _f(r["budget_seconds"], ".1f"), str(r["budget_step"]), _f(r["budget_loss"]),
                        _f(r["budget_metric"]),
                        "baseline" if r["baseline"] == r["arm"] else f"{_f(r['wallclock_delta_pct'], '+.2f', '%')} vs {r['baseline']}"]
                       for r in quality if r["budget_loss"] is not None or r["baseline"] == r["arm"]]), ""]
    grid = tables.get("stability") or []
    if grid:
        out += ["## 4-bit stability (diverged runs / runs)", "",
                "Diverged: non-finite loss, or final eval loss above its value before training.", "",
                table(["format", "arm", "lr", "diverged", "final eval loss per seed"],
                      [[c["fmt"], c["arm"], f"{c['lr']:g}", f"{c['diverged']}/{c['runs']}",
                        ", ".join(_f(x) for x in c["final_losses"])] for c in grid]), ""]
        named = only_full_diverges(grid)
        out.append("Full backprop diverges where LCSB does not: " + (", ".join(named) if named else "none") + ".")
        out.append("")
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    return "\n".join(out)


def write_results(out_dir: Path, tables: Mapping[str, Any], meta: Mapping[str, Any], plots: Sequence[str] = ()) -> None:
    """Write ``results.json`` (tables and meta) and ``results.md`` into ``out_dir``."""
    atomic_write_json(out_dir / "results.json", {"meta": dict(meta), **tables})
    tmp = out_dir / ".results.md.tmp"
    tmp.write_text(markdown(tables, meta, plots))
    tmp.replace(out_dir / "results.md")
