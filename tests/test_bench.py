"""Pure pieces of the reproduction benchmark: arms, resume, divergence rule, tables, results files (seconds)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from lcsb_lightning.bench import report
from lcsb_lightning.bench.runner import run_benchmark, validate
from lcsb_lightning.bench.spec import (
    RESULT_NAME, Arm, arm_dir, diverged, load_result, pending, quality_arms, slug, stability_arms,
)
from lcsb_lightning.recipes.cli import benchmark_main, conf_dir


def bench_cfg(name: str) -> Any:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="benchmark", overrides=[f"benchmark={name}"]).benchmark


QUALITY = {
    "model": "tiny", "tasks": ["t1", "t2"], "seed": 0, "steps": 4, "common": ["experiment=paper"],
    "task_overrides": {"t2": ["seq_len=99"]},
    "arms": {
        "lcsb": {"baseline": "full", "overrides": ["policy=cyclic"]},
        "full": {"baseline": None, "overrides": ["policy=full"]},
    },
}
STABILITY = {"model": "tiny", "task": "t1", "steps": 3, "formats": ["nf4", "int4"], "lrs": [1e-4, 1e-3],
             "seeds": [0, 1, 2], "common": [], "arms": {"full": ["policy=full"], "cyclic_n4": ["policy=cyclic"]}}


# ------------------------------------------------------------------------------------ arms
def test_quality_arms_put_baselines_first_and_carry_overrides_in_order() -> None:
    arms = quality_arms(QUALITY)
    assert [a.name for a in arms] == ["t1__full", "t1__lcsb", "t2__full", "t2__lcsb"]
    assert arms[1].baseline == "t1__full" and arms[0].baseline is None
    assert arms[3].overrides == ("model=tiny", "task=t2", "seed=0", "experiment=paper", "seq_len=99", "policy=cyclic")


def test_quality_arms_reject_unknown_baseline_and_task_override() -> None:
    bad = {**QUALITY, "arms": {"lcsb": {"baseline": "nope", "overrides": []}}}
    with pytest.raises(ValueError, match="baseline 'nope' is not an arm"):
        quality_arms(bad)
    with pytest.raises(ValueError, match="task_overrides for tasks not in"):
        quality_arms({**QUALITY, "task_overrides": {"t9": []}})


def test_stability_arms_cover_the_grid() -> None:
    arms = stability_arms(STABILITY)
    assert len(arms) == 2 * 2 * 2 * 3
    assert len({a.name for a in arms}) == len(arms)
    a = arms[0]
    assert a.labels == {"arm": "full", "fmt": "nf4", "lr": 1e-4, "seed": 0}
    assert a.overrides[-3:] == ("mebp=nf4", "module.lr=0.0001", "seed=0")


def test_slug_is_folder_safe() -> None:
    assert slug("sst2", "cyclic n4", "lr/1") == "sst2__cyclic-n4__lr-1"


def test_validate_rejects_unknown_study() -> None:
    with pytest.raises(ValueError, match="subset of"):
        validate({"studies": ["quality", "bogus"]})


@pytest.mark.parametrize("name, n_quality, n_speed, n_stability", [("short", 24, 3, 12), ("full", 24, 9, 36)])
def test_benchmark_configs_compose_and_expand(name: str, n_quality: int, n_speed: int, n_stability: int) -> None:
    arms = validate(dict(bench_cfg(name)))
    assert (len(arms["quality"]), len(arms["speed"]), len(arms["stability"])) == (n_quality, n_speed, n_stability)
    assert callable(benchmark_main)


def test_full_config_carries_the_issue_settings() -> None:
    b = bench_cfg("full")
    assert "experiment=paper" in b.quality.common and b.stability.seeds == [0, 1, 2]
    assert list(b.stability.lrs) == [1e-4, 3e-4, 1e-3] and list(b.stability.formats) == ["nf4", "int4"]
    assert b.speed.seq_len == 256 and list(b.speed.shapes) == ["qwen2.5_0.5b", "qwen2.5_1.5b", "gemma3_1b"]


# ------------------------------------------------------------------------------ divergence
@pytest.mark.parametrize("losses, initial, final, expected", [
    ([2.0, 1.0], 3.0, 2.0, False),
    ([2.0, math.inf], 3.0, 2.0, True),
    ([2.0, math.nan], 3.0, 2.0, True),
    ([2.0], 3.0, math.nan, True),
    ([2.0], 3.0, None, True),
    ([2.0], 3.0, 3.0, False),   # equal to the start is not above it
    ([2.0], 3.0, 3.01, True),
])
def test_divergence_rule(losses: list[float], initial: float, final: float | None, expected: bool) -> None:
    bad, reason = diverged(losses, initial, final)
    assert bad is expected and bool(reason) is expected


# ---------------------------------------------------------------------------------- tables
def quality_result(task: str, arm: str, baseline: str | None, start: float, end: float, budget: float, acc: float) -> dict:
    return {
        "study": "quality", "name": slug(task, arm), "labels": {"task": task, "arm": arm},
        "baseline": slug(task, baseline) if baseline else None, "equal_steps": 4,
        "eval_at_steps": {"0": {"val/loss": start, "val/accuracy": 0.5}, "4": {"val/loss": end, "val/accuracy": acc}},
        "eval_at_budget": {"step": 9, "train_seconds": 2.0, "metrics": {"val/loss": budget, "val/accuracy": acc}},
        "train_seconds_at_steps": 2.0, "diverged": False, "divergence_reason": "",
        "curves": {"steps": [1, 2, 3, 4], "train_loss": [3.0, 2.5, 2.2, 2.0], "train_seconds": [0.5, 1, 1.5, 2],
                   "selections": [[0], [1], [2], [3]], "evals": []},
        "summary": {"steps_per_second": 2.0, "num_blocks": 4},
    }


def test_quality_rows_degradation_and_wallclock() -> None:
    rows = report.quality_rows([
        quality_result("sst2", "full", None, 3.0, 2.0, 2.0, 0.8),
        quality_result("sst2", "lcsb", "full", 3.0, 2.04, 1.9, 0.7),
    ])
    full, lcsb = rows
    assert full["degradation_pct"] == 0.0 and full["baseline"] == "full"
    assert lcsb["degradation_pct"] == pytest.approx(2.0)
    assert lcsb["wallclock_delta_pct"] == pytest.approx(-5.0)
    assert (lcsb["metric_name"], lcsb["metric"], lcsb["initial_metric"]) == ("accuracy", 0.7, 0.5)


def test_task_metric_and_rel_change() -> None:
    assert report.task_metric({"val/loss": 1.0, "val/ppl": 2.7}) == ("ppl", 2.7)
    assert report.task_metric({"val/exact_match": 0.25, "val/ppl": 2.7}) == ("exact_match", 0.25)
    assert report.rel_change(None, 1.0) is None and report.rel_change(math.nan, 1.0) is None


def test_speed_rows_speedup_and_amdahl_bound() -> None:
    timing = {"s": {"arms": {"full": {"median_s": 4.0, "steps_per_s": 0.25, "k": 8},
                             "cyclic_n4": {"median_s": 2.0, "steps_per_s": 0.5, "k": 2}},
                    "forward_median_s": 1.0, "num_blocks": 8}}
    memory = [{"labels": {"shape": "s", "arm": "full"}, "peak_rss_mb": 900.0}]
    rows = {r["arm"]: r for r in report.speed_rows(timing, memory)}
    assert rows["cyclic_n4"]["speedup"] == pytest.approx(2.0)
    assert rows["cyclic_n4"]["amdahl_bound"] == pytest.approx(4.0 / (1.0 + 3.0 * 2 / 8))
    assert rows["full"]["peak_rss_mb"] == 900.0 and rows["cyclic_n4"]["peak_rss_mb"] is None


def stability_result(arm: str, fmt: str, lr: float, seed: int, bad: bool) -> dict:
    return {"labels": {"arm": arm, "fmt": fmt, "lr": lr, "seed": seed}, "equal_steps": 3, "diverged": bad,
            "divergence_reason": "non-finite training loss at step 2" if bad else "",
            "eval_at_steps": {"0": {"val/loss": 3.0}, "3": {"val/loss": math.nan if bad else 2.5}}}


def test_stability_grid_counts_and_names_full_only_divergence() -> None:
    grid = report.stability_grid([
        stability_result("full", "nf4", 1e-3, 0, True), stability_result("full", "nf4", 1e-3, 1, False),
        stability_result("cyclic_n4", "nf4", 1e-3, 0, False), stability_result("cyclic_n4", "nf4", 1e-3, 1, False),
        stability_result("full", "int4", 1e-3, 0, True), stability_result("cyclic_n4", "int4", 1e-3, 0, True),
    ])
    cell = next(c for c in grid if (c["arm"], c["fmt"]) == ("full", "nf4"))
    assert (cell["runs"], cell["diverged"]) == (2, 1) and "seed 0" in cell["reasons"][0]
    assert report.only_full_diverges(grid) == ["nf4 lr=0.001"]
    md = report.markdown({"stability": grid}, {"name": "x"})
    assert "| nf4 | full | 0.001 | 1/2 |" in md and "nf4 lr=0.001" in md


# ---------------------------------------------------------------------------------- resume
def test_pending_skips_arms_with_a_readable_result(tmp_path: Path) -> None:
    arms = quality_arms(QUALITY)
    (arm_dir(tmp_path, arms[0])).mkdir(parents=True)
    (arm_dir(tmp_path, arms[0]) / RESULT_NAME).write_text("{}")
    (arm_dir(tmp_path, arms[1])).mkdir(parents=True)
    (arm_dir(tmp_path, arms[1]) / RESULT_NAME).write_text('{"half-writ')  # interrupted: rerun
    assert pending(tmp_path, arms) == arms[1:]
    assert load_result(tmp_path, arms[0]) == {}


def test_finished_benchmark_reruns_nothing_and_writes_results(tmp_path: Path) -> None:
    bench = {"name": "resume", "studies": ["quality", "stability"], "quality": QUALITY, "stability": STABILITY}
    for arm in quality_arms(QUALITY):
        base = arm.labels["arm"] == "full"
        res = quality_result(arm.labels["task"], arm.labels["arm"], None if base else "full", 3.0, 2.0, 2.0, 0.6)
        (arm_dir(tmp_path, arm)).mkdir(parents=True)
        (arm_dir(tmp_path, arm) / RESULT_NAME).write_text(json.dumps(res))
    for arm in stability_arms(STABILITY):
        l = arm.labels
        res = stability_result(l["arm"], l["fmt"], l["lr"], l["seed"], False)
        (arm_dir(tmp_path, arm)).mkdir(parents=True)
        (arm_dir(tmp_path, arm) / RESULT_NAME).write_text(json.dumps(res))

    def compose(overrides: Any) -> Any:
        raise AssertionError(f"a finished arm was run again: {overrides}")

    tables = run_benchmark(bench, tmp_path, compose, command="test")
    assert len(tables["quality"]) == 4 and len(tables["stability"]) == 8
    assert (tmp_path / "results.md").is_file() and json.loads((tmp_path / "results.json").read_text())["meta"]["command"] == "test"
    for name in ("loss_curves", "selection_heatmap", "divergence_grid"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000
    assert "![divergence_grid](plots/divergence_grid.png)" in (tmp_path / "results.md").read_text()


def test_a_missing_baseline_result_is_an_error(tmp_path: Path) -> None:
    q = {**QUALITY, "tasks": ["t1"], "task_overrides": {}}
    lcsb = quality_arms(q)[1]
    with pytest.raises(RuntimeError, match="baseline t1__full"):
        from lcsb_lightning.bench.runner import _run_quality

        _run_quality([lcsb], q, tmp_path, lambda o: None)


def test_report_only_runs_nothing(tmp_path: Path) -> None:
    bench = {"name": "r", "report_only": True, "studies": ["stability"], "stability": STABILITY}

    def compose(overrides: Any) -> Any:
        raise AssertionError("report_only ran an arm")

    tables = run_benchmark(bench, tmp_path, compose, command="test")
    assert tables["stability"] == [] and (tmp_path / "results.md").is_file()


def test_an_arm_capped_before_its_budget_uses_its_final_eval() -> None:
    base = quality_result("w", "full", None, 3.0, 2.0, 2.0, 0.5)
    lcsb = quality_result("w", "lcsb", "full", 3.0, 2.1, 0.0, 0.5)
    lcsb["eval_at_budget"] = None
    lcsb["summary"] = {"steps": 16, "final_metrics": {"val/loss": 1.9}}
    lcsb["curves"]["total_train_seconds"] = 1.5
    row = report.quality_rows([base, lcsb])[1]
    assert (row["budget_step"], row["budget_seconds"], row["budget_loss"]) == (16, 1.5, 1.9)
    assert row["wallclock_delta_pct"] == pytest.approx(-5.0)
