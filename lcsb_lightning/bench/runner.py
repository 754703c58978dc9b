"""The resumable benchmark driver: run the configured studies' pending arms, then tables, plots and results.

An arm's ``result.json`` carries a hash of the settings that produced it; a rerun skips an arm only
when that hash matches its current settings, and runs it again otherwise (never reporting stale
numbers under new settings).
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lcsb_lightning.bench import cost_model, plots, report
from lcsb_lightning.bench.finetune_arm import (
    Compose, arm_config, arm_settings, run_finetune_arm, run_finetune_arm_in_fresh_process,
)
from lcsb_lightning.bench.time_to_quality import (
    StepTime, best_of_sweep, elapsed, ratios_by_share, recorded_step_time, step_time_by_epoch, steps_within,
    time_to_quality_rows, timed_as_step_times,
)
from lcsb_lightning.bench.spec import (
    FINETUNE_STUDIES, RESULT_NAME, STUDIES, Arm, arm_dir, finetune_arms, finished, load_result, memory_arms, pending,
    recipe_speed_arms, slug, stability_arms, without_disabled_arms,
)
from lcsb_lightning.atomic_files import atomic_write_json

log = logging.getLogger(__name__)


EXPAND: dict[str, Callable[[Mapping[str, Any]], list[Arm]]] = {
    "quality": partial(finetune_arms, "quality"), "ablation": partial(finetune_arms, "ablation"),
    "recipe_speed": recipe_speed_arms, "memory": memory_arms, "stability": stability_arms,
    "cost_model": cost_model.arms,
}


def _share(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


def validate(bench: Mapping[str, Any]) -> dict[str, list[Arm]]:
    """Check the benchmark config and expand every requested study into its arms (before any work).

    An arm set to ``null`` is left out (:func:`~lcsb_lightning.bench.spec.without_disabled_arms`).

    Raises:
        ValueError: unknown study, or an inconsistent study section.
    """
    bench = without_disabled_arms(bench)
    studies = list(bench.get("studies") or [])
    if not studies or any(s not in STUDIES for s in studies):
        raise ValueError(f"benchmark.studies must be a non-empty subset of {list(STUDIES)}, got {studies}")
    missing = [s for s in studies if s not in bench]
    if missing:
        raise ValueError(f"benchmark.studies names {missing} but the benchmark config has no such section")
    arms = {s: EXPAND[s](bench[s]) for s in studies}
    for study in (s for s in (*FINETUNE_STUDIES, "stability") if s in arms):
        section = bench[study]
        if int(section["steps"]) < 1:
            raise ValueError(f"benchmark.{study}.steps must be >= 1, got {section['steps']}")
        extra, fresh = section.get("extra_eval_steps") or [], section.get("fresh_process", False)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in extra):
            raise ValueError(f"benchmark.{study}.extra_eval_steps must be a list of positive step numbers, "
                             f"got {extra!r}")
        if not isinstance(fresh, bool):
            raise ValueError(f"benchmark.{study}.fresh_process must be true or false, got {fresh!r}")
    if "quality" in arms:
        q = bench["quality"]
        if not _share(share := q.get("target_share", 0.9)):
            raise ValueError(f"benchmark.quality.target_share must be in (0, 1], got {share!r}")
        if not all(map(_share, others := q.get("other_shares") or [])):
            raise ValueError(f"benchmark.quality.other_shares must be shares in (0, 1], got {others!r}")
        swept = sorted(name for name, arm in (q.get("arms") or {}).items() if arm.get("baseline") is not None)
        if unknown := [name for name in q.get("baseline_sweep") or [] if name not in swept]:
            raise ValueError(f"benchmark.quality.baseline_sweep names {unknown[0]!r}, which is not a quality arm "
                             f"with a baseline; allowed: {swept}")
        _check_timed_as(q.get("arms") or {}, (bench.get("recipe_speed") or {}).get("arms") or {})
    return arms


def _check_timed_as(arms: Mapping[str, Any], timed_arms: Mapping[str, Any]) -> None:
    for name, arm in arms.items():
        match phases := arm.get("timed_as"):
            case None:
                pass
            case [[twin, None]]:  # a sequence of one [arm, null] pair (a string is no sequence pattern)
                if twin not in timed_arms:
                    raise ValueError(f"benchmark.quality.arms.{name}.timed_as names {[twin]}, which the recipe_speed "
                                     f"study does not time; allowed: {sorted(timed_arms)}")
            case _:
                raise ValueError(f"benchmark.quality.arms.{name}.timed_as must be [[arm, null]] (timed as that "
                                 f"recipe_speed arm, whose step it shares), got {phases!r}")


def machine() -> str:
    """CPU count, memory, torch threads and versions of this machine, in words."""
    import psutil
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, {gpu}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; Python {platform.python_version()}")


# ------------------------------------------------------------------------- fine-tuning studies
def _recipe_speed_rows(root: Path, bench: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows of the finished ``recipe_speed`` arms of the config, whether or not this run names the study."""
    r = bench.get("recipe_speed")
    return report.recipe_speed_rows(finished(root, recipe_speed_arms(r)) if r else [])


def wallclock_steps(root: Path, bench: Mapping[str, Any], arm: Arm, steps: int) -> int:
    """The steps an equal-wall-clock arm trains: as many as its step time (a ``timed_as`` arm's: its twin's)
    pays for in the time the baseline took for ``steps``, and never fewer than ``steps``.

    Raises:
        RuntimeError: the recipe_speed study has not timed the arm (or its ``timed_as`` twin).
    """
    task, name = arm.labels["task"], arm.labels["arm"]
    r = bench.get("recipe_speed") or {}
    seconds = step_times({"recipe_speed": _recipe_speed_rows(root, bench)}, bench)
    own_baseline = (((bench.get(arm.study) or {}).get("arms") or {}).get(name) or {}).get("baseline")
    per_step, base = seconds.get((task, name)), seconds.get((task, own_baseline or r.get("baseline")))
    timing_study = bool(r) and "recipe_speed" in bench.get("studies", ("recipe_speed",))
    if per_step is None and not timing_study:  # no recipe_speed study run: the step times the runs recorded
        own, baseline = (load_result(root, Arm(arm.study, n)) if n else None for n in (arm.wallclock_of, arm.baseline))
        if own is not None and baseline is not None:
            epoch = ((bench.get("quality") or {}).get("steps_per_epoch"))
            mine, theirs = recorded_step_time(own, epoch), recorded_step_time(baseline, epoch)
            return max(steps, round(steps_within(mine, elapsed(theirs, steps))))
    if per_step is None or not isinstance(base, float):
        phases = (((bench.get("quality") or {}).get("arms") or {}).get(name) or {}).get("timed_as")
        needed = [phases[0][0]] if phases else [name]
        raise RuntimeError(
            f"{arm.study} arm {arm.name} trains for its baseline's wall-clock time, which needs the speed-up "
            f"of {', '.join(map(repr, needed))} on {task!r} from the recipe_speed study: add it to "
            "benchmark.studies (before this study) with that task and arm"
        )
    return max(steps, round(steps_within(per_step, steps * base)))


def evaluation_steps(run_steps: int, every: int, extra: Sequence[int] = ()) -> list[int]:
    """The steps a fine-tuning arm evaluates at: every ``every`` steps (0: none), the ``extra`` steps below
    ``run_steps`` (dense early evaluations, where a curve falls fastest), and the last step.

    Example::

        >>> evaluation_steps(100, 25, extra=[5, 10, 25, 300])
        [5, 10, 25, 50, 75, 100]
    """
    regular = range(every, run_steps, every) if every else ()
    return sorted({*regular, *(int(s) for s in extra if 0 < int(s) < run_steps), run_steps})


def _run_finetune_study(arms: Sequence[Arm], q: Mapping[str, Any], root: Path, compose: Compose,
                        bench: Mapping[str, Any]) -> None:
    steps, every, fresh = int(q["steps"]), int(q.get("eval_every") or 0), bool(q.get("fresh_process", False))
    run = run_finetune_arm_in_fresh_process if fresh else run_finetune_arm
    for arm in arms:
        run_steps = steps if arm.wallclock_of is None else wallclock_steps(root, bench, arm, steps)
        eval_steps = evaluation_steps(run_steps, every, q.get("extra_eval_steps") or ())
        cfg = arm_config(arm, compose, run_steps, int(q.get("probe_every") or 0))
        if pending(root, arm, arm_settings(cfg, eval_steps, fresh)) is None:
            continue
        log.info("%s %s: running %d steps%s", arm.study, arm.name, run_steps, " in a fresh process" if fresh else "")
        run(arm, arm_dir(root, arm), cfg, run_steps, eval_steps)
        gc.collect()


# ----------------------------------------------------------------------------- timing studies
def _run_recipe_speed(arms: Sequence[Arm], r: Mapping[str, Any], root: Path, compose: Compose, bench: Mapping[str, Any]) -> None:
    from lcsb_lightning.bench.recipe_speed import time_task

    for arm in arms:
        task = arm.labels["task"]
        settings = {"task": task, "arms": r["arms"], "common": [*r.get("common", ()), *r.get("task_overrides", {}).get(task, ())],
                    "rounds": r["rounds"], "steps_per_round": r["steps_per_round"], "model": r["model"]}
        if (expected := pending(root, arm, settings)) is None:
            continue
        folder = arm_dir(root, arm)
        common = [f"model={r['model']}", *settings["common"]]
        timing = time_task(task, {n: list(o) for n, o in r["arms"].items()}, common, compose, r["rounds"],
                           r["steps_per_round"], folder / "logs")
        atomic_write_json(folder / RESULT_NAME, {"study": "recipe_speed", "name": arm.name, "labels": dict(arm.labels),
                                                 "baseline": r["baseline"], "timing": timing, "settings_hash": expected})
        gc.collect()


def _run_memory(arms: Sequence[Arm], m: Mapping[str, Any], root: Path, compose: Compose, bench: Mapping[str, Any]) -> None:
    from lcsb_lightning.bench import memory

    configs = {**m["configs"], **(m.get("ablations") or {})}
    for arm in arms:  # one fresh process per arm
        shape, name = arm.labels["shape"], arm.labels["config"]
        model_config = OmegaConf.to_container(compose([f"model={shape}"]).model.config, resolve=True)
        options = configs[name]
        spec = {"arm": "qlora" if options == "qlora" else "mebp", "model_config": model_config,
                "options": {} if options == "qlora" else {"group_size": 64, **dict(options)},
                "seq_len": arm.labels["seq_len"], "rank": int(m["rank"]), "warmup": int(m["warmup"]), "steps": int(m["steps"])}
        if arm.labels["optimizer"] != "adamw":  # AdamW, the study's default, keeps the settings (and results) it had
            spec["optimizer"] = arm.labels["optimizer"]
        if (expected := pending(root, arm, spec)) is None:
            continue
        if spec["arm"] == "qlora":  # from_pretrained needs a saved folder; load_compressed builds the init itself
            spec["folder"] = str(root / "memory" / "_models" / slug(shape))
            memory.save_random_init(model_config, Path(spec["folder"]))
        log.info("memory %s: running in a fresh process", arm.name)
        out = arm_dir(root, arm)
        figures = memory.measure(spec, out / "memory.json", timeout=m.get("timeout_s"))
        atomic_write_json(out / RESULT_NAME, {"study": "memory", "name": arm.name, "labels": dict(arm.labels),
                                              **figures, "settings_hash": expected})


RUNNERS: dict[str, Callable[..., None]] = {
    "recipe_speed": _run_recipe_speed, "quality": _run_finetune_study, "ablation": _run_finetune_study,
    "memory": _run_memory, "stability": _run_finetune_study,
    "cost_model": cost_model.run,
}


def step_times(tables: Mapping[str, Any], bench: Mapping[str, Any]) -> dict[tuple[str, str], StepTime]:
    """``(task, arm) ->`` the recipe-loop step time, a ``timed_as`` quality arm's its twin's; without a
    recipe_speed study, each quality arm's own recorded mean step time (per epoch with ``steps_per_epoch``)."""
    q = bench.get("quality") or {}
    timed = report.step_seconds(tables.get("recipe_speed") or [])
    out: dict[tuple[str, str], StepTime] = {**timed, **timed_as_step_times(q.get("arms") or {}, timed)}
    if not timed:
        for r in tables.get("_quality_raw") or []:
            if r["labels"].get("run") == "steps":
                out.setdefault((r["labels"]["task"], r["labels"]["arm"]), recorded_step_time(r, q.get("steps_per_epoch")))
    return out


def collect(root: Path, arms: Mapping[str, Sequence[Arm]], bench: Mapping[str, Any]) -> dict[str, Any]:
    """Tables from every finished arm (missing arms are left out)."""
    tables: dict[str, Any] = {}
    recipe = _recipe_speed_rows(root, bench)
    speed_ups: dict[str, dict[str, float]] = {}
    for row in recipe:
        if row["speedup"] is not None:
            speed_ups.setdefault(row["task"], {})[row["arm"]] = row["speedup"]
    for study in FINETUNE_STUDIES:
        if study in arms:
            res = finished(root, arms[study])
            tables[study] = report.finetune_rows(res, speed_ups)
            tables[f"_{study}_raw"] = res
            tables[f"{study}_probes"] = report.probe_rows(res)
    if "recipe_speed" in arms:
        tables["recipe_speed"] = recipe
    if tables.get("_quality_raw"):
        q, seconds = bench.get("quality") or {}, step_times(tables, bench)
        raw = best_of_sweep(tables["_quality_raw"], list(q.get("baseline_sweep") or []))
        tables["time_to_quality"] = time_to_quality_rows(raw, seconds, float(q.get("target_share", 0.9)))
        if q.get("other_shares"):
            tables["time_to_quality_by_share"] = ratios_by_share(raw, seconds, list(q["other_shares"]))
        if q.get("steps_per_epoch"):
            tables["step_time_by_epoch"] = step_time_by_epoch(tables["_quality_raw"], int(q["steps_per_epoch"]))
    if "memory" in arms:
        tables["memory"] = report.memory_rows(finished(root, arms["memory"]), bench["memory"].get("anchors"))
    if "stability" in arms:
        tables["stability"] = report.stability_grid(finished(root, arms["stability"]))
    if "cost_model" in arms:
        tables.update(cost_model.tables(root, arms["cost_model"], bench["cost_model"]))
    return tables


def make_plots(root: Path, tables: Mapping[str, Any], bench: Mapping[str, Any]) -> list[str]:
    """Draw every plot the tables allow; returns their paths relative to ``root``."""
    out: list[Path] = []
    step_seconds = step_times(tables, bench)
    for study in FINETUNE_STUDIES:
        raw = tables.get(f"_{study}_raw")
        if raw:
            targets = {r["task"]: r["target_loss"] for r in tables.get("time_to_quality") or []} if study == "quality" else None
            out.append(plots.loss_curves(raw, step_seconds, root / "plots" / f"{study}_loss_curves.png", targets))
            out.append(plots.selection_heatmap(raw, root / "plots" / f"{study}_selection_heatmap.png"))
            if any(r["curves"].get("probes") for r in raw):
                out.append(plots.alignment(raw, root / "plots" / f"{study}_alignment.png"))
    if tables.get("memory"):
        out.append(plots.memory_bars(tables["memory"], root / "plots" / "memory.png"))
    if tables.get("recipe_speed"):
        out.append(plots.phase_bars(tables["recipe_speed"], root / "plots" / "recipe_speed_phases.png"))
    if tables.get("stability"):
        out.append(plots.divergence_grid(tables["stability"], root / "plots" / "divergence_grid.png"))
    if tables.get("cost_model"):
        out.append(plots.cost_constant(tables["cost_model"], root / "plots" / "cost_model_constant.png"))
    return [str(p.relative_to(root)) for p in out]


def run_benchmark(bench: DictConfig | Mapping[str, Any], out_dir: str | Path, compose: Compose,
                  command: str | None = None) -> dict[str, Any]:
    """Run the pending arms of the configured studies and write ``results.md``, ``results.json`` and plots.

    An arm whose ``result.json`` was produced by the same settings is skipped, so an interrupted benchmark resumes;
    with ``report_only`` nothing runs and the results cover the finished arms.

    Args:
        bench: The ``benchmark`` config node (``conf/benchmark/*.yaml``).
        out_dir: The benchmark's run directory.
        compose: Composes the fine-tuning config (``conf/config.yaml``) from overrides.
        command: The command line to record (default: ``sys.argv``).

    Returns:
        The tables written to ``results.json``.
    """
    bench = without_disabled_arms(OmegaConf.to_container(bench, resolve=True) if isinstance(bench, DictConfig) else bench)
    arms = validate(bench)
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    load_before = os.getloadavg()
    if not bench.get("report_only", False):
        for study in STUDIES:  # in dependency order, whatever the order in the config
            if study in arms:
                RUNNERS[study](arms[study], bench[study], root, compose, bench)
    tables = collect(root, arms, bench)
    paths = make_plots(root, tables, bench)
    meta = {
        "name": bench.get("name", ""), "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": machine(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_seconds_this_invocation": round(time.perf_counter() - start, 1),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "config": bench,
    }
    public = {k: v for k, v in tables.items() if not k.startswith("_")}
    report.write_results(root, public, meta, paths)
    log.info("benchmark results in %s (results.md, results.json, %d plots)", root, len(paths))
    return public
