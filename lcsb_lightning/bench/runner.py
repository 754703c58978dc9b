"""The resumable benchmark driver: run the configured studies' pending arms, then tables, plots and results."""

from __future__ import annotations

import gc
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lcsb_lightning.bench import plots, report
from lcsb_lightning.bench.finetune_arm import Compose, run_finetune_arm
from lcsb_lightning.bench.spec import (
    RESULT_NAME, STUDIES, Arm, arm_dir, load_result, quality_arms, slug, speed_arms, stability_arms,
)
from lcsb_lightning.recipes.outputs import atomic_write_json

log = logging.getLogger(__name__)


def validate(bench: Mapping[str, Any]) -> dict[str, list[Arm]]:
    """Check the benchmark config and expand every requested study into its arms (before any work).

    Raises:
        ValueError: unknown study, or an inconsistent study section.
    """
    studies = list(bench.get("studies") or [])
    unknown = [s for s in studies if s not in STUDIES]
    if unknown or not studies:
        raise ValueError(f"benchmark.studies must be a non-empty subset of {list(STUDIES)}, got {studies}")
    expand = {"quality": quality_arms, "speed": speed_arms, "stability": stability_arms}
    arms = {s: expand[s](bench[s]) for s in studies}
    for study in ("quality", "stability"):
        if study in arms and int(bench[study]["steps"]) < 1:
            raise ValueError(f"benchmark.{study}.steps must be >= 1")
    return arms


def machine() -> str:
    """CPU count, memory, torch threads and versions of this machine, in words."""
    import psutil
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, {gpu}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; Python {platform.python_version()}")


def _run_quality(arms: Sequence[Arm], q: Mapping[str, Any], root: Path, compose: Compose) -> None:
    steps, every = int(q["steps"]), int(q.get("eval_every") or 0)
    eval_steps = list(range(every, steps, every)) if every else []
    for arm in arms:
        if load_result(root, arm) is not None:
            log.info("quality %s: done, skipped", arm.name)
            continue
        budget = None
        if arm.baseline and arm.wallclock:
            base = load_result(root, Arm("quality", arm.baseline))
            budget = (base or {}).get("train_seconds_at_steps")
            if budget is None:
                raise RuntimeError(f"quality arm {arm.name}: its baseline {arm.baseline} has no train time; run it first")
        log.info("quality %s: running (budget %s s)", arm.name, budget)
        run_finetune_arm(arm, arm_dir(root, arm), compose, steps, eval_steps, budget,
                         max_steps=int(q.get("max_steps_factor", 4)) * steps)
        gc.collect()


def _run_stability(arms: Sequence[Arm], s: Mapping[str, Any], root: Path, compose: Compose) -> None:
    for arm in arms:
        if load_result(root, arm) is not None:
            log.info("stability %s: done, skipped", arm.name)
            continue
        log.info("stability %s: running", arm.name)
        run_finetune_arm(arm, arm_dir(root, arm), compose, int(s["steps"]))
        gc.collect()


def _run_speed(arms: Sequence[Arm], s: Mapping[str, Any], root: Path, compose: Compose) -> None:
    from lcsb_lightning.bench import speed

    chunk = s.get("chunk_size") or None
    shapes = list(dict.fromkeys(a.labels["shape"] for a in arms))
    configs: dict[str, Any] = {}

    def model_cfg(shape: str) -> Any:  # composed only when an arm of that shape still has to run
        if shape not in configs:
            configs[shape] = OmegaConf.to_container(compose([f"model={shape}"]).model.config, resolve=True)
        return configs[shape]

    if s.get("memory", True):
        for arm in arms:  # one fresh process per arm
            if load_result(root, arm) is not None:
                log.info("speed memory %s: done, skipped", arm.name)
                continue
            log.info("speed memory %s: running in a fresh process", arm.name)
            folder = arm_dir(root, arm)
            folder.mkdir(parents=True, exist_ok=True)
            spec = {"model_config": model_cfg(arm.labels["shape"]), "fmt": s["fmt"], "fraction": arm.labels["fraction"],
                    "seq_len": int(s["seq_len"]), "steps": int(s["memory_steps"]), "rank": int(s["rank"]), "chunk_size": chunk}
            mem = speed.memory_subprocess(spec, folder / "memory.json", timeout=s.get("memory_timeout_s"))
            atomic_write_json(folder / RESULT_NAME, {"study": "speed", "name": arm.name, "labels": dict(arm.labels), **mem})
    fractions = {name: float(f) for name, f in s["arms"].items()}
    for shape in shapes:
        timing = Arm("speed", slug(shape, "timing"))
        if load_result(root, timing) is not None:
            log.info("speed timing %s: done, skipped", shape)
            continue
        log.info("speed timing %s: building the model, then %s alternating steps per arm", shape, s["steps"])
        model = speed.build_model(model_cfg(shape), s["fmt"], int(s["rank"]), seed=0)
        out = speed.time_arms(model, fractions, int(s["seq_len"]), int(s["steps"]), int(s.get("warmup", 1)),
                              chunk, vocab=min(256, int(model_cfg(shape)["vocab_size"])), log=log.info)
        del model
        gc.collect()
        atomic_write_json(arm_dir(root, timing) / RESULT_NAME, {"study": "speed", "name": timing.name, "shape": shape, **out})


def collect(root: Path, arms: Mapping[str, Sequence[Arm]]) -> dict[str, Any]:
    """Tables from every finished arm (missing arms are left out)."""
    tables: dict[str, Any] = {}
    if "quality" in arms:
        res = [r for a in arms["quality"] if (r := load_result(root, a)) is not None]
        tables["quality"] = report.quality_rows(res)
        tables["_quality_raw"] = res
    if "speed" in arms:
        shapes = list(dict.fromkeys(a.labels["shape"] for a in arms["speed"]))
        timing = {s: r for s in shapes if (r := load_result(root, Arm("speed", slug(s, "timing")))) is not None}
        memory = [r for a in arms["speed"] if (r := load_result(root, a)) is not None]
        tables["speed"] = report.speed_rows(timing, memory)
    if "stability" in arms:
        res = [r for a in arms["stability"] if (r := load_result(root, a)) is not None]
        tables["stability"] = report.stability_grid(res)
    return tables


def make_plots(root: Path, tables: Mapping[str, Any]) -> list[str]:
    """Draw every plot the tables allow; returns their paths relative to ``root``."""
    out: list[Path] = []
    if tables.get("_quality_raw"):
        out.append(plots.loss_curves(tables["_quality_raw"], root / "plots" / "loss_curves.png"))
        out.append(plots.selection_heatmap(tables["_quality_raw"], root / "plots" / "selection_heatmap.png"))
    if [r for r in tables.get("speed") or [] if r.get("median_s") is not None or r.get("peak_rss_mb") is not None]:
        out.append(plots.speed_bars(tables["speed"], root / "plots" / "speed_memory.png"))
    if tables.get("stability"):
        out.append(plots.divergence_grid(tables["stability"], root / "plots" / "divergence_grid.png"))
    return [str(p.relative_to(root)) for p in out]


def run_benchmark(bench: DictConfig | Mapping[str, Any], out_dir: str | Path, compose: Compose,
                  command: str | None = None) -> dict[str, Any]:
    """Run the pending arms of the configured studies and write ``results.md``, ``results.json`` and plots.

    An arm whose ``result.json`` exists is skipped, so an interrupted benchmark resumes where it stopped.
    With ``report_only`` nothing runs: the tables, plots and results files cover the finished arms.

    Args:
        bench: The ``benchmark`` config node (``conf/benchmark/*.yaml``).
        out_dir: The benchmark's run directory.
        compose: Composes the fine-tuning config (``conf/config.yaml``) from overrides.
        command: The command line to record (default: ``sys.argv``).

    Returns:
        The tables written to ``results.json``.
    """
    bench = OmegaConf.to_container(bench, resolve=True) if isinstance(bench, DictConfig) else dict(bench)
    arms = validate(bench)
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    load_before = os.getloadavg()
    runners: dict[str, Callable[..., None]] = {"quality": _run_quality, "speed": _run_speed, "stability": _run_stability}
    if not bench.get("report_only", False):
        for study in bench["studies"]:
            runners[study](arms[study], bench[study], root, compose)
    tables = collect(root, arms)
    paths = make_plots(root, tables)
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
