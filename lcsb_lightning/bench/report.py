"""Tables of the benchmark (pure functions of the arms' results) and the ``results.md``/``results.json`` writers."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lcsb_lightning.atomic_files import atomic_write_json

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


def _final(r: Mapping[str, Any]) -> dict[str, Any] | None:
    return r["eval_at_steps"].get(str(r["summary"].get("steps") or r["steps"]))


def retention(initial: float | None, loss: float | None, baseline: float | None) -> float | None:
    """Share of the baseline's eval-loss improvement an arm keeps: ``(L0 - L) / (L0 - L_base)``."""
    if None in (initial, loss, baseline) or initial == baseline:
        return None
    return (initial - loss) / (initial - baseline)  # type: ignore[operator]


def eval_rises(r: Mapping[str, Any], tolerance: float = 0.005) -> bool:
    """Whether the eval loss ends above its best by more than ``tolerance`` while the training loss kept
    falling (the failure the identity path shows on a real model)."""
    evals = sorted((int(s), m.get("val/loss")) for s, m in r["eval_at_steps"].items() if m and m.get("val/loss") is not None)
    if len(evals) < 3:
        return False
    best_step, best = min(evals, key=lambda e: e[1])
    final_step, final = evals[-1]
    losses = r["curves"]["train_loss"]

    def train_at(step: int, window: int = 10) -> float:
        part = losses[max(0, step - window) : max(step, 1)]
        return sum(part) / len(part) if part else math.inf

    return final > best + tolerance and train_at(final_step) < train_at(best_step)


def finetune_rows(results: Sequence[Mapping[str, Any]], speed_ups: Mapping[str, Mapping[str, float]]) -> list[Row]:
    """One row per fine-tuning arm: final eval loss and task metric, the share of the baseline's
    improvement retained, the change against the baseline, and the arm's recipe-loop speed-up.

    Equal-steps arms are compared with the baseline after the same steps; an equal-wall-clock arm
    (``run == "wallclock"``) trained ``steps x speed-up`` steps, the time the baseline took for its
    steps, and is compared with the baseline's final evaluation.
    """
    by_name = {r["name"]: r for r in results}
    rows: list[Row] = []
    for r in results:
        labels = r["labels"]
        base = by_name.get(r["baseline"] or r["name"])
        base_final = _loss(_final(base)) if base else None
        initial = _loss(r["eval_at_steps"].get("0"))
        final = _final(r)
        metric_name, metric = task_metric(final)
        rows.append({
            "task": labels["task"], "arm": labels["arm"], "run": labels.get("run", "steps"),
            "baseline": (base or {}).get("labels", {}).get("arm"), "steps": r["summary"].get("steps"),
            "initial_loss": initial, "loss": _loss(final), "metric_name": metric_name, "metric": metric,
            "initial_metric": task_metric(r["eval_at_steps"].get("0"))[1],
            "retention": retention(initial, _loss(final), base_final),
            "delta_pct": rel_change(_loss(final), base_final) if r["baseline"] else 0.0,
            "speedup": _speedup_over(speed_ups.get(labels["task"], {}), labels["arm"], (base or {}).get("labels", {}).get("arm")),
            "peak_rss_mb": r["summary"].get("peak_rss_mb") if r.get("fresh_process") else None,
            "eval_rises": eval_rises(r), "diverged": r.get("diverged"),
            "train_seconds": (r.get("curves") or {}).get("total_train_seconds"),
        })
    return rows


def _speedup_over(speed_ups: Mapping[str, float], arm: str, baseline: str | None) -> float | None:
    """The arm's speed-up over its own baseline, from speed-ups over the recipe_speed study's one baseline."""
    mine, theirs = speed_ups.get(arm), speed_ups.get(baseline or arm)
    return mine / theirs if mine is not None and theirs else None


def block_groups(num_blocks: int, groups: int = 4) -> list[list[int]]:
    """Consecutive groups of blocks from the bottom (``groups`` of near-equal size)."""
    from lcsb_lightning.policies import balanced_groups

    return balanced_groups(list(range(num_blocks)), min(groups, num_blocks))


def probe_rows(results: Sequence[Mapping[str, Any]], groups: int = 4) -> list[Row]:
    """Gradient alignment over training, per arm and depth group: mean cosine of the gradient used
    against the exact one, the share of probed block gradients pointing the right way (cosine > 0),
    and the mean norm ratio."""
    rows: list[Row] = []
    for r in results:
        probes = (r.get("curves") or {}).get("probes") or []
        num_blocks = int((r.get("summary") or {}).get("num_blocks") or 0)
        if not probes or not num_blocks:
            continue
        for g, blocks in enumerate(block_groups(num_blocks, groups)):
            cos = [p["cosine"][str(b)] for p in probes for b in blocks if str(b) in p["cosine"]]
            ratio = [p["norm_ratio"][str(b)] for p in probes for b in blocks if str(b) in p["norm_ratio"]]
            if not cos:
                continue
            rows.append({"task": r["labels"]["task"], "arm": r["labels"]["arm"], "run": r["labels"].get("run", "steps"),
                         "group": g, "blocks": f"{blocks[0]}-{blocks[-1]}", "n": len(cos),
                         "mean_cos": sum(cos) / len(cos), "share_positive": sum(c > 0 for c in cos) / len(cos),
                         "mean_norm_ratio": sum(ratio) / len(ratio) if ratio else None})
    return rows


def recipe_speed_rows(results: Sequence[Mapping[str, Any]]) -> list[Row]:
    """One row per task x arm of the recipe-loop timing: step time (the median over rounds of each round's mean
    over whole policy cycles), speed-up, and its phases."""
    rows: list[Row] = []
    for r in results:
        arms = r["timing"]["arms"]
        base = arms.get(r["baseline"], {}).get("total")
        for name, phases in arms.items():
            rows.append({"task": r["labels"]["task"], "arm": name, "step_s": phases.get("total"),
                         "speedup": base / phases["total"] if base and phases.get("total") else None,
                         "phases": {k: v for k, v in phases.items() if k != "total"},
                         "loadavg": [r["timing"].get("loadavg_before"), r["timing"].get("loadavg_after")]})
    return rows


def step_seconds(recipe_rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], float]:
    """``(task, arm) -> recipe-loop step time``, the wall-clock axis of the loss plots."""
    return {(r["task"], r["arm"]): r["step_s"] for r in recipe_rows if r.get("step_s")}


def memory_rows(results: Sequence[Mapping[str, Any]], anchors: Mapping[str, Any] | None = None) -> list[Row]:
    """One row per memory arm: the anchors' metric beside their figures, RSS, s/step and the breakdown."""
    keys = ("peak_anon_train_mb", "peak_anon_load_mb", "peak_rss_above_import_mb", "peak_rss_mb", "step_s", "breakdown")
    rows = []
    for r in results:
        labels = {**dict(r["labels"]), "optimizer": r["labels"].get("optimizer", "adamw")}  # AdamW before the field
        beside = {f"{name}_mb": (figures.get(labels["shape"]) or {}).get(labels["seq_len"])
                  for name, figures in (anchors or {}).items()}
        rows.append({**labels, **{k: r.get(k) for k in keys}, **beside})
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
        cell["final_losses"].append(_loss(_final(r)))
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


def _finetune_section(title: str, rows: Sequence[Row], probes: Sequence[Row]) -> list[str]:
    out = [f"## {title}", "",
           "Retention = (L0 - L) / (L0 - L_full): the share of full backprop's eval-loss improvement an arm keeps "
           "(equal steps: after the same steps; equal wall-clock: after the time full backprop took). "
           "Speed-up: recipe-loop step time of the arm's baseline over the arm's (recipe_speed study). Peak RSS: "
           "the arm's whole-process peak, where each arm ran in a process of its own (fresh_process).", "",
           table(["task", "arm", "run", "steps", "eval loss (start -> end)", "metric (start -> end)", "retention",
                  "vs full", "speed-up", "peak RSS (MiB)", "eval rises"],
                 [[r["task"], r["arm"], r["run"], str(r["steps"]), f"{_f(r['initial_loss'])} -> {_f(r['loss'])}",
                   f"{r['metric_name']} {_f(r['initial_metric'])} -> {_f(r['metric'])}",
                   _f(None if r["retention"] is None else 100 * r["retention"], ".1f", "%"),
                   "baseline" if r["baseline"] == r["arm"] and r["run"] == "steps" else _f(r["delta_pct"], "+.2f", "%"),
                   _f(r["speedup"], ".2f", "x"), _f(r.get("peak_rss_mb"), ".0f"), "yes" if r["eval_rises"] else "no"]
                  for r in rows]), ""]
    if probes:
        out += [f"### Gradient alignment over training ({title.lower()})", "",
                "Per depth group (bottom first), over every probe of the run: mean cosine between the gradient "
                "the step used and the exact gradient on the same batch, the share of probed block gradients "
                "pointing the right way (cosine > 0), and the mean norm ratio |used| / |exact|.", "",
                table(["task", "arm", "group", "blocks", "probes", "mean cosine", "cosine > 0", "norm ratio"],
                      [[p["task"], p["arm"], str(p["group"]), p["blocks"], str(p["n"]), _f(p["mean_cos"]),
                        _f(100 * p["share_positive"], ".0f", "%"), _f(p["mean_norm_ratio"], ".2f")] for p in probes]), ""]
    return out


def _time_to_quality_section(rows: Sequence[Row]) -> list[str]:
    share = rows[0]["share"]
    return ["## Time to quality", "",
            f"Target: {100 * share:.0f}% of full backprop's eval-loss improvement, L0 - {share:g} (L0 - L_full). "
            "Time to target: training wall-clock (steps x the arm's recipe-loop step time; without a recipe_speed "
            "study, x its own recorded mean step time, per epoch where the study sets steps_per_epoch) at which the eval loss "
            "first reaches it, interpolated between evaluations; ratio < 1 is faster to quality than full backprop. "
            "The ratio is the steps ratio (steps to target over full backprop's) times the step-time ratio (mean "
            "step time up to the target over full backprop's). "
            "At full backprop's wall-clock: the final eval loss of the arm's equal-wall-clock run (its schedule fitted "
            "to that time), or read off its equal-steps curve where it has none. Reached in: the equal-steps run, or "
            "the equal-wall-clock run (own schedule) where the equal steps did not reach the target. Against: the "
            "baseline of the row; with a baseline_sweep, the lowest final eval loss of the baseline and the swept arms.", "",
            table(["task", "arm", "against", "eval loss start -> target", "steps to target", "time to target (s)",
                   "ratio to full", "steps ratio", "step-time ratio", "eval loss at full's wall-clock (full's final)",
                   "from", "reached in", "evaluations"],
                  [[r["task"], r["arm"], r["baseline"], f"{_f(r['initial_loss'])} -> {_f(r['target_loss'])}", _f(r["reach_step"], ".0f"),
                    _f(r["reach_seconds"], ".0f"), f"**{_f(r['ratio_to_full'], '.2f', 'x')}**",
                    _f(r.get("steps_ratio"), ".2f", "x"), _f(r.get("step_time_ratio"), ".2f", "x"),
                    f"{_f(r['loss_at_full_wallclock'])} ({_f(r['full_final_loss'])})", r["at_full_wallclock_from"],
                    r.get("reached_in") or "-", str(r["eval_points"])] for r in rows]), ""]


def _by_share_section(rows: Sequence[Row]) -> list[str]:
    shares = sorted({share for r in rows for share in r["ratios"]})
    return ["### Time to quality at other targets", "",
            "Ratio to full backprop's time to reach each share of its improvement (the same curves and step "
            "times; -: not reached in the run).", "",
            table(["task", "arm", *(f"{100 * s:.0f}%" for s in shares)],
                  [[r["task"], r["arm"], *(_f(r["ratios"].get(s), ".2f", "x") for s in shares)] for r in rows]), ""]


def _by_epoch_section(rows: Sequence[Row]) -> list[str]:
    epochs = max(len(r["epochs"]) for r in rows)
    return ["### Recorded step time by epoch", "",
            "Median train seconds per step of each epoch, as each run recorded it (evaluations excluded; the arms ran "
            "one after another: compare them only from a run made alone). Total: the recorded train time.", "",
            table(["task", "arm", *(f"epoch {e}" for e in range(epochs)), "total (s)"],
                  [[r["task"], r["arm"], *(_f(v) for v in r["epochs"]), *([""] * (epochs - len(r["epochs"]))),
                    _f(r["total_seconds"], ".0f")] for r in rows]), ""]


def markdown(tables: Mapping[str, Any], meta: Mapping[str, Any], plots: Sequence[str] = ()) -> str:
    """``results.md``: every study's tables, time to quality first."""
    out = [f"# LCSB benchmark: {meta.get('name', '')}", "",
           f"Command: `{meta.get('command', '')}`  ", f"Machine: {meta.get('machine', '')}  ",
           f"Date: {meta.get('date', '')}", ""]
    if tables.get("time_to_quality"):
        out += _time_to_quality_section(tables["time_to_quality"])
    if tables.get("time_to_quality_by_share"):
        out += _by_share_section(tables["time_to_quality_by_share"])
    if tables.get("step_time_by_epoch"):
        out += _by_epoch_section(tables["step_time_by_epoch"])
    recipe = tables.get("recipe_speed") or []
    if recipe:
        phase_names = [p for p in ("forward", "zero_grad", "backward", "before_step", "clip", "optimizer", "between",
                                   "lm_head_forward", "lm_head_backward") if any(p in r["phases"] for r in recipe)]
        out += ["## Speed in the recipe's own training loop (arms alternating in one process; per arm the median "
                "over rounds of each round's mean over whole policy cycles)", "",
                table(["task", "arm", "s/step", "speed-up", *phase_names],
                      [[r["task"], r["arm"], _f(r["step_s"]), _f(r["speedup"], ".2f", "x"),
                        *[_f(r["phases"].get(p)) for p in phase_names]] for r in recipe]), ""]
        loads = {r["task"]: r["loadavg"] for r in recipe if r.get("loadavg") and r["loadavg"][0]}
        out += [f"Load average (1, 5, 15 min) before -> after timing {task}: "
                f"{', '.join(f'{x:.1f}' for x in la[0])} -> {', '.join(f'{x:.1f}' for x in la[1])}  " for task, la in loads.items()]
        out.append("")
    for study, title in (("quality", "Quality"), ("ablation", "Ablations")):
        if tables.get(study):
            out += _finetune_section(title, tables[study], tables.get(f"{study}_probes") or [])
    memory = tables.get("memory") or []
    if memory:
        anchors = [k for k in memory[0] if k.endswith("_mb") and k.split("_")[0] in ("mebp", "mesp")]
        out += ["## Memory (the anchors' metric; one fresh process per arm)", "",
                "Peak anonymous memory (RssAnon) inside the step and while loading, above the state after imports; "
                "peak RSS above imports and whole-process; the anchors' figures beside.", "",
                table(["shape", "seq", "config", "optimizer", "train anon (MB)", *[a[:-3] + " (MB)" for a in anchors],
                       "load anon (MB)", "RSS above imports (MB)", "whole RSS (MB)", "s/step"],
                      [[r["shape"], str(r["seq_len"]), r["config"], r["optimizer"], _f(r["peak_anon_train_mb"], ".0f"),
                        *[_f(r.get(a), ".1f") for a in anchors], _f(r["peak_anon_load_mb"], ".0f"),
                        _f(r["peak_rss_above_import_mb"], ".0f"), _f(r["peak_rss_mb"], ".0f"), _f(r["step_s"], ".2f")]
                       for r in memory]), "",
                "Breakdown of each training peak by owner (MB; the window holding the peak):", "",
                table(["shape", "seq", "config", "optimizer", "window", *memory[0]["breakdown"]["owners_mb"], "accounted"],
                      [[r["shape"], str(r["seq_len"]), r["config"], r["optimizer"], r["breakdown"]["window"],
                        *[_f(v, ".1f") for v in r["breakdown"]["owners_mb"].values()], _f(r["breakdown"].get("accounted"), ".0%")]
                       for r in memory]), ""]
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
    out += _cost_model_section(tables)
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    return "\n".join(out)


def _params(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _cost_model_section(tables_: Mapping[str, Any]) -> list[str]:
    """The cost-model study's sections (none without rows): the fits, then the projection, labelled as such."""
    from lcsb_lightning.bench.cost_model import SPLIT

    rows_ = tables_.get("cost_model") or []
    if not rows_:
        return []
    out = ["## Step-cost model: t(d) / t_full = a + b d (fixed-depth arms alternating in one process)", "",
           "a and b: least squares over every round's points; spread: max - min of the per-round a. The split of a: "
           "each phase's fitted intercept (forward: the blocks with their decompression; LM head + loss: from the "
           "head's first forward call to the end of training_step; backward: its constant, the head's and the loss's "
           "backward; rest: zero_grad, LCSB's gradient bookkeeping, clipping, between steps), shares of t_full.", "",
           table(["shape", "params", "pipeline", "blocks", "t_full (s)", "a", "b", "spread of a", *SPLIT],
                 [[r["shape"], _params(r["params"]), r["pipeline"], str(r["num_blocks"]), _f(r["full_s"], ".2f"), _f(r["a"]),
                   _f(r["b"]), _f(r["a_spread"]), *[_f(r["split"][k]) for k in SPLIT]] for r in rows_]), ""]
    proj = tables_.get("cost_model_projection") or []
    if proj:
        shapes = list(dict.fromkeys(s for p in proj for s in p["ratios"]))
        targets = list(proj[0]["break_even"])
        out += ["### Projection (on paper, not measured): time to quality against full backprop, s (a + b d)", "",
                "s: the policy's measured steps to the target as a ratio to full backprop's (from the config); a, b: "
                "the fits above. From: the smallest parameter count projected to reach the ratio (linear in log(params) "
                "between the measured shapes; the smallest shape where it already does).", "",
                table(["pipeline", "policy", "d", "s", *shapes, *[f"from ({t}x)" for t in targets]],
                      [[p["pipeline"], p["policy"], _f(p["depth"]), _f(p["steps_ratio"], ".2f", "x"),
                        *[_f(p["ratios"].get(s), ".2f", "x") for s in shapes],
                        *[_params(p["break_even"][t]) if p["break_even"][t] else "none" for t in targets]] for p in proj]), ""]
    return out


def write_results(out_dir: Path, tables: Mapping[str, Any], meta: Mapping[str, Any], plots: Sequence[str] = ()) -> None:
    """Write ``results.json`` (tables and meta) and ``results.md`` into ``out_dir``."""
    atomic_write_json(out_dir / "results.json", {"meta": dict(meta), **tables})
    tmp = out_dir / ".results.md.tmp"
    tmp.write_text(markdown(tables, meta, plots))
    tmp.replace(out_dir / "results.md")
