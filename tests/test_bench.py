"""Pure pieces of the benchmark: arms, results keyed by settings, divergence rule, tables, results files (seconds)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _recipes_utils import finetune_composer
from hydra import compose, initialize_config_module

from lcsb_lightning.bench import report
from lcsb_lightning.bench.runner import run_benchmark, validate
from lcsb_lightning.bench.spec import (
    RESULT_NAME, Arm, arm_dir, diverged, finetune_arms, load_result, settings_hash, slug, stability_arms,
    without_disabled_arms,
)
from lcsb_lightning.recipes.cli import CONFIG_MODULE


def bench_cfg(name: str) -> Any:
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="benchmark", overrides=[f"benchmark={name}"]).benchmark


QUALITY = {
    "model": "tiny", "tasks": ["t1", "t2"], "seed": 0, "steps": 4, "common": ["experiment=paper"],
    "task_overrides": {"t2": ["seq_len=99"]},
    "arms": {
        "lcsb": {"baseline": "full", "wallclock": True, "overrides": ["policy=cyclic"]},
        "full": {"baseline": None, "overrides": ["policy=full"]},
    },
}
STABILITY = {"model": "tiny", "task": "t1", "steps": 3, "formats": ["nf4", "int4"], "lrs": [1e-4, 1e-3],
             "seeds": [0, 1, 2], "common": [], "arms": {"full": ["policy=full"], "cyclic_n4": ["policy=cyclic"]}}


# ------------------------------------------------------------------------------------ arms
def test_finetune_arms_put_baselines_first_and_add_wallclock_twins() -> None:
    arms = finetune_arms("quality", QUALITY)
    assert [a.name for a in arms] == ["t1__full", "t1__lcsb", "t1__lcsb__wallclock", "t2__full", "t2__lcsb", "t2__lcsb__wallclock"]
    assert arms[1].baseline == "t1__full" and arms[0].baseline is None
    assert arms[2].wallclock_of == "t1__lcsb" and arms[2].labels["run"] == "wallclock" and arms[2].baseline == "t1__full"
    assert arms[4].overrides == ("model=tiny", "task=t2", "seed=0", "experiment=paper", "seq_len=99", "policy=cyclic")


def test_finetune_arms_reject_unknown_baseline_and_task_override() -> None:
    bad = {**QUALITY, "arms": {"lcsb": {"baseline": "nope", "overrides": []}}}
    with pytest.raises(ValueError, match="baseline 'nope' is not an arm"):
        finetune_arms("quality", bad)
    with pytest.raises(ValueError, match=r"task_overrides for tasks not in quality.tasks and not packaged.*\['t9'\]"):
        finetune_arms("quality", {**QUALITY, "task_overrides": {"t9": []}})


def test_task_overrides_of_a_packaged_task_outside_tasks_are_kept_for_later_and_not_applied() -> None:
    # a preset holds every task's overrides, so that "benchmark.quality.tasks=[gsm8k]" is the whole command
    arms = finetune_arms("quality", {**QUALITY, "task_overrides": {"t2": ["seq_len=99"], "gsm8k": ["seq_len=256"]}})
    assert {a.labels["task"] for a in arms} == {"t1", "t2"}
    assert not any("seq_len=256" in a.overrides for a in arms)


def test_an_arm_set_to_null_is_left_out_of_its_study() -> None:
    bench = {"studies": ["recipe_speed", "quality"],
             "recipe_speed": {"tasks": ["t1"], "baseline": "full", "arms": {"full": [], "lcsb": None}},
             "quality": {**QUALITY, "tasks": ["t1"], "task_overrides": {}, "arms": {**QUALITY["arms"], "lcsb": None}}}
    arms = validate(bench)
    assert [a.name for a in arms["quality"]] == ["t1__full"]
    assert without_disabled_arms(bench)["recipe_speed"]["arms"] == {"full": []}


def test_a_preset_drops_inherited_arms_and_the_command_line_drops_more() -> None:
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        int4 = compose(config_name="benchmark", overrides=["benchmark=multi_epoch_int4"]).benchmark
        fewer = compose(config_name="benchmark",
                        overrides=["benchmark=multi_epoch_int4", "benchmark.quality.arms.dyadic=null"]).benchmark
    assert int4.quality.task_overrides == bench_cfg("multi_epoch").quality.task_overrides  # inherited, not repeated
    assert [a.labels["arm"] for a in validate(dict(int4))["quality"]] == ["full", "dyadic"]
    assert [a.labels["arm"] for a in validate(dict(fewer))["quality"]] == ["full"]


def test_stability_arms_cover_the_grid() -> None:
    arms = stability_arms(STABILITY)
    assert len(arms) == 2 * 2 * 2 * 3
    assert len({a.name for a in arms}) == len(arms)
    a = arms[0]
    assert a.labels == {"arm": "full", "fmt": "nf4", "lr": 1e-4, "seed": 0}
    assert a.overrides[-3:] == ("mebp=nf4", "module.lr=0.0001", "seed=0")


def test_slug_is_folder_safe() -> None:
    assert slug("sst2", "cyclic n4", "lr/1") == "sst2__cyclic-n4__lr-1"


@pytest.mark.parametrize(("bench", "match"), [
    ({"studies": ["quality", "bogus"]}, "subset of"),
    ({"studies": ["quality"]}, "has no such section"),
    ({"studies": ["quality"], "quality": {**QUALITY, "extra_eval_steps": [5, 0]}}, "extra_eval_steps must be a list"),
    ({"studies": ["quality"], "quality": {**QUALITY, "extra_eval_steps": ["5"]}}, "extra_eval_steps must be a list"),
])
def test_validate_rejects_bad_studies(bench: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate(bench)


@pytest.mark.parametrize(("name", "counts"), [
    ("short", {"quality": 6, "stability": 12}),
    ("standard", {"recipe_speed": 3, "quality": 21}),
    ("ablation", {"ablation": 12}),
    ("time_to_quality", {"recipe_speed": 3, "quality": 30}),
    ("recipe_defaults", {"recipe_speed": 1, "quality": 6}),
    ("multi_epoch", {"quality": 5}),
    ("multi_epoch_int4", {"recipe_speed": 1, "quality": 2}),
    ("full", {"recipe_speed": 3, "quality": 15, "memory": 9, "stability": 54}),
    ("memory_anchor", {"memory": 17}),
    ("cost_model", {"cost_model": 8}),
])
def test_benchmark_configs_compose_and_expand(name: str, counts: dict[str, int]) -> None:
    arms = validate(dict(bench_cfg(name)))
    assert {study: len(a) for study, a in arms.items()} == counts


def test_every_fine_tuning_arm_of_the_configs_composes() -> None:
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        for name in ("standard", "ablation", "time_to_quality", "multi_epoch", "multi_epoch_int4", "recipe_defaults"):
            bench = compose(config_name="benchmark", overrides=[f"benchmark={name}"]).benchmark
            for arms in validate(dict(bench)).values():
                for arm in arms:
                    compose(config_name="config", overrides=["data_dir=/data", *arm.overrides])


def test_console_script_composes_the_packaged_benchmark_config(tmp_path: Path) -> None:
    script = shutil.which("lcsb-benchmark") or str(Path(sys.executable).parent / "lcsb-benchmark")
    done = subprocess.run([script, "--cfg", "job", "benchmark=full"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "name: full" in done.stdout and "studies:" in done.stdout


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
def finetune_result(task: str, arm: str, baseline: str | None, evals: dict[int, float], run: str = "steps",
                    train_loss: list[float] | None = None, acc: float = 0.7) -> dict:
    steps = max(evals)
    return {
        "study": "quality", "name": slug(task, arm, *(["wallclock"] if run == "wallclock" else [])),
        "labels": {"task": task, "arm": arm, "run": run}, "baseline": slug(task, baseline) if baseline else None,
        "wallclock_of": slug(task, arm) if run == "wallclock" else None, "steps": steps,
        "eval_at_steps": {str(s): {"val/loss": v, "val/accuracy": 0.5 if s == 0 else acc} for s, v in evals.items()},
        "diverged": False, "divergence_reason": "",
        "curves": {"steps": list(range(1, steps + 1)), "train_loss": train_loss or [3.0 - 0.01 * i for i in range(steps)],
                   "train_seconds": [0.5 * i for i in range(1, steps + 1)], "selections": [[0]] * steps, "evals": [],
                   "probes": [{"step": 0, "cosine": {"0": 0.2, "3": 1.0}, "norm_ratio": {"0": 0.5, "3": 1.0}},
                              {"step": 1, "cosine": {"1": -0.4}, "norm_ratio": {"1": 0.3}}]},
        "summary": {"steps": steps, "num_blocks": 4},
    }


def test_finetune_rows_retention_change_and_speedup() -> None:
    rows = report.finetune_rows([
        finetune_result("sst2", "full", None, {0: 3.0, 4: 2.0}),
        finetune_result("sst2", "lcsb", "full", {0: 3.0, 4: 2.1}),
        finetune_result("sst2", "lcsb", "full", {0: 3.0, 6: 1.95}, run="wallclock"),
    ], {"sst2": {"full": 1.0, "lcsb": 1.5}})
    full, lcsb, wallclock = rows
    assert full["retention"] == 1.0 and full["delta_pct"] == 0.0 and full["baseline"] == "full"
    assert lcsb["retention"] == pytest.approx(0.9) and lcsb["delta_pct"] == pytest.approx(5.0) and lcsb["speedup"] == 1.5
    assert wallclock["steps"] == 6 and wallclock["retention"] == pytest.approx(1.05) and wallclock["delta_pct"] == pytest.approx(-2.5)
    assert (lcsb["metric_name"], lcsb["metric"], lcsb["initial_metric"]) == ("accuracy", 0.7, 0.5)


@pytest.mark.parametrize(("fresh", "expected_peak"), [(True, 612.0), (False, None)])
def test_finetune_rows_compare_each_arm_with_its_own_baseline(fresh: bool, expected_peak: float | None) -> None:
    # two baselines timed against recipe_speed's one (full_k4): each arm's speed-up is over its own baseline;
    # an arm's whole-process peak is a figure only when the arm ran in a process of its own
    results = [finetune_result("w", "full_k4", None, {0: 3.0, 4: 2.0}), finetune_result("w", "full_null", None, {0: 3.0, 4: 2.0}),
               finetune_result("w", "default_null", "full_null", {0: 3.0, 4: 2.1})]
    for r in results:
        r["summary"]["peak_rss_mb"], r["fresh_process"] = 612.0, fresh
    rows = report.finetune_rows(results, {"w": {"full_k4": 1.0, "full_null": 1.6, "default_null": 2.0}})
    assert rows[2]["speedup"] == pytest.approx(1.25) and rows[1]["speedup"] == 1.0
    assert rows[2]["peak_rss_mb"] == expected_peak


def test_eval_rising_while_training_loss_falls_is_flagged() -> None:
    falling = [3.0 - 0.01 * i for i in range(30)]
    rising = finetune_result("w", "identity", "full", {0: 3.0, 10: 2.5, 20: 2.6, 30: 2.8}, train_loss=falling)
    steady = finetune_result("w", "truncated", "full", {0: 3.0, 10: 2.5, 20: 2.45, 30: 2.44}, train_loss=falling)
    assert report.eval_rises(rising) and not report.eval_rises(steady)


def test_probe_rows_per_depth_group() -> None:
    rows = report.probe_rows([finetune_result("w", "identity", "full", {0: 3.0, 4: 2.5})])
    by_group = {r["group"]: r for r in rows}
    assert by_group[0]["mean_cos"] == pytest.approx(0.2) and by_group[0]["share_positive"] == 1.0
    assert by_group[1]["share_positive"] == 0.0 and by_group[3]["mean_norm_ratio"] == 1.0
    assert 2 not in by_group  # never probed


def test_task_metric_and_rel_change() -> None:
    assert report.task_metric({"val/loss": 1.0, "val/ppl": 2.7}) == ("ppl", 2.7)
    assert report.task_metric({"val/exact_match": 0.25, "val/ppl": 2.7}) == ("exact_match", 0.25)
    assert report.rel_change(None, 1.0) is None and report.rel_change(math.nan, 1.0) is None


def test_memory_table_gets_its_bar_plot(tmp_path: Path) -> None:
    from lcsb_lightning.bench.runner import make_plots

    rows = [{"shape": "s", "seq_len": 8, "config": c, "peak_anon_train_mb": mb} for c, mb in (("qlora", 9.0), ("lean", 4.0))]
    assert make_plots(tmp_path, {"memory": rows}, {}) == ["plots/memory.png"]
    assert (tmp_path / "plots" / "memory.png").stat().st_size > 1000


def test_recipe_speed_rows_and_step_seconds() -> None:
    result = {"labels": {"task": "w"}, "baseline": "full",
              "timing": {"arms": {"full": {"total": 2.0, "forward": 1.0}, "dyadic": {"total": 1.25, "forward": 0.9}}}}
    rows = report.recipe_speed_rows([result])
    assert [r["speedup"] for r in rows] == [1.0, pytest.approx(1.6)] and rows[1]["phases"] == {"forward": 0.9}
    assert report.step_seconds(rows) == {("w", "full"): 2.0, ("w", "dyadic"): 1.25}


def stability_result(arm: str, fmt: str, lr: float, seed: int, bad: bool) -> dict:
    return {"labels": {"arm": arm, "fmt": fmt, "lr": lr, "seed": seed}, "steps": 3, "diverged": bad,
            "divergence_reason": "non-finite training loss at step 2" if bad else "", "summary": {"steps": 3},
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


# -------------------------------------------------------------------- results keyed by settings
def _write(root: Path, arm: Arm, result: dict, settings: Any) -> None:
    arm_dir(root, arm).mkdir(parents=True, exist_ok=True)
    (arm_dir(root, arm) / RESULT_NAME).write_text(json.dumps({**result, "settings_hash": settings_hash(settings)}))


def test_a_result_counts_only_for_the_settings_that_produced_it(tmp_path: Path) -> None:
    arm = Arm("quality", "t1__full")
    _write(tmp_path, arm, {"x": 1}, {"steps": 200})
    assert load_result(tmp_path, arm, settings_hash({"steps": 200})) is not None
    assert load_result(tmp_path, arm, settings_hash({"steps": 20})) is None  # other settings: run again
    (arm_dir(tmp_path, arm) / RESULT_NAME).write_text('{"half-writ')  # interrupted: run again
    assert load_result(tmp_path, arm) is None


def test_an_arm_is_pending_until_it_finished_with_these_settings(tmp_path: Path) -> None:
    from lcsb_lightning.bench.spec import pending

    arm = Arm("memory", "m")
    assert pending(tmp_path, arm, {"steps": 2}) == settings_hash({"steps": 2})
    _write(tmp_path, arm, {"x": 1}, {"steps": 2})
    assert pending(tmp_path, arm, {"steps": 2}) is None
    assert pending(tmp_path, arm, {"steps": 3}) == settings_hash({"steps": 3})


def test_finished_arms_are_skipped_and_changed_settings_run_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lcsb_lightning.bench import runner
    from lcsb_lightning.bench.finetune_arm import arm_config, arm_settings

    ran: list[str] = []
    monkeypatch.setattr(runner, "run_finetune_arm", lambda arm, *args, **kwargs: ran.append(arm.name))
    bench = {"name": "resume", "studies": ["stability"], "stability": {**STABILITY, "task": "pydoc"}}
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        def compose_ft(overrides: Any) -> Any:
            return compose(config_name="config", overrides=list(overrides))

        for arm in stability_arms(bench["stability"]):
            lab = arm.labels
            settings = arm_settings(arm_config(arm, compose_ft, 3), [3])
            _write(tmp_path, arm, stability_result(lab["arm"], lab["fmt"], lab["lr"], lab["seed"], False), settings)
        tables = run_benchmark(bench, tmp_path, compose_ft, command="test")
        assert ran == [] and len(tables["stability"]) == 8
        assert json.loads((tmp_path / "results.json").read_text())["meta"]["command"] == "test"
        assert (tmp_path / "plots" / "divergence_grid.png").stat().st_size > 1000
        assert "![divergence_grid](plots/divergence_grid.png)" in (tmp_path / "results.md").read_text()
        bench["stability"]["steps"] = 4  # other settings: every arm runs again, nothing stale is reported
        run_benchmark(bench, tmp_path, compose_ft, command="test")
        assert len(ran) == 24


@pytest.mark.parametrize(("run_steps", "every", "extra", "expected"), [
    (100, 25, [], [25, 50, 75, 100]),
    (100, 25, [5, 10, 15, 20], [5, 10, 15, 20, 25, 50, 75, 100]),
    (100, 25, [25, 100, 150], [25, 50, 75, 100]),  # no duplicates, nothing past the run
    (30, 0, [10], [10, 30]),
])
def test_evaluation_steps_add_dense_early_evaluations(run_steps: int, every: int, extra: list[int], expected: list[int]) -> None:
    from lcsb_lightning.bench.runner import evaluation_steps

    assert evaluation_steps(run_steps, every, extra) == expected


def test_a_wallclock_arm_needs_the_recipe_speed_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    from lcsb_lightning.bench import runner

    ran: list[str] = []
    monkeypatch.setattr(runner, "run_finetune_arm", lambda arm, *args, **kwargs: ran.append(arm.name))
    bench = {"name": "q", "studies": ["quality"], "quality": {**QUALITY, "tasks": ["t1"], "task_overrides": {}}}

    def compose_stub(overrides: Any) -> Any:
        return OmegaConf.create({"policy": {"_target_": "lcsb_lightning.policies.CyclicPolicy"}, "lcsb": {"probe_every": 0},
                                 "o": list(overrides)})

    with pytest.raises(RuntimeError, match="needs the speed-up of 'lcsb' on 't1' from the recipe_speed study"):
        run_benchmark(bench, tmp_path, compose_stub, command="t")
    assert ran == ["t1__full", "t1__lcsb"]  # the equal-steps arms ran before the wall-clock one stopped


def test_report_only_runs_nothing(tmp_path: Path) -> None:
    bench = {"name": "r", "report_only": True, "studies": ["stability"], "stability": STABILITY}

    def compose_stub(overrides: Any) -> Any:
        raise AssertionError("report_only ran an arm")

    tables = run_benchmark(bench, tmp_path, compose_stub, command="test")
    assert tables["stability"] == [] and (tmp_path / "results.md").is_file()


def _timed(tmp_path: Path, task: str, seconds: dict[str, float]) -> None:
    folder = tmp_path / "recipe_speed" / task
    folder.mkdir(parents=True)
    arms = {name: {"total": s} for name, s in seconds.items()}
    (folder / "result.json").write_text(json.dumps({"labels": {"task": task}, "baseline": "full",
                                                    "timing": {"arms": arms}}))


@pytest.mark.parametrize(("arm", "quality_arm", "expected"), [
    # a plain arm: steps x its speed-up (3.6 / 1.8 = 2)
    ("dyadic", {"baseline": "full", "wallclock": True, "overrides": []}, 400),
    # an arm timed as its twin: the twin's speed-up
    ("dyadic_lr", {"baseline": "full", "wallclock": True, "overrides": [], "timed_as": [["dyadic", None]]}, 400),
])
def test_wallclock_steps_fill_the_baselines_time(tmp_path: Path, arm: str, quality_arm: dict, expected: int) -> None:
    from lcsb_lightning.bench.runner import wallclock_steps
    from lcsb_lightning.bench.spec import Arm

    _timed(tmp_path, "t1", {"full": 3.6, "dyadic": 1.8})
    bench = {"recipe_speed": {"tasks": ["t1"], "baseline": "full", "arms": {"full": [], "dyadic": []}},
             "quality": {"arms": {arm: quality_arm}}}
    wallclock = Arm("quality", f"t1__{arm}__wallclock", (), {"task": "t1", "arm": arm, "run": "wallclock"}, "t1__full",
                    wallclock_of=f"t1__{arm}")
    assert wallclock_steps(tmp_path, bench, wallclock, 200) == expected


def test_wallclock_steps_fill_the_arms_own_baselines_time(tmp_path: Path) -> None:
    # recipe_speed's baseline is full_k4, the arm's own baseline full_null: 100 x (1.6 / 1.2) steps
    from lcsb_lightning.bench.runner import wallclock_steps
    from lcsb_lightning.bench.spec import Arm

    _timed(tmp_path, "t1", {"full_k4": 2.6, "full_null": 1.6, "default_null": 1.2})
    bench = {"recipe_speed": {"tasks": ["t1"], "baseline": "full_k4", "arms": {"full_k4": [], "full_null": [], "default_null": []}},
             "quality": {"arms": {"default_null": {"baseline": "full_null", "wallclock": True, "overrides": []}}}}
    wallclock = Arm("quality", "t1__default_null__wallclock", (), {"task": "t1", "arm": "default_null", "run": "wallclock"},
                    "t1__full_null", wallclock_of="t1__default_null")
    assert wallclock_steps(tmp_path, bench, wallclock, 100) == 133


def test_wallclock_steps_of_an_ablation_arm_read_the_ablation_study(tmp_path: Path) -> None:
    # the same arm name in the quality study with another baseline must not decide the ablation arm's steps
    from lcsb_lightning.bench.runner import wallclock_steps
    from lcsb_lightning.bench.spec import Arm

    _timed(tmp_path, "t1", {"full_k4": 2.6, "full_null": 1.6, "default_null": 1.2})
    bench = {"recipe_speed": {"tasks": ["t1"], "baseline": "full_k4", "arms": {"full_k4": [], "full_null": [], "default_null": []}},
             "quality": {"arms": {"default_null": {"baseline": "full_k4", "wallclock": True, "overrides": []}}},
             "ablation": {"arms": {"default_null": {"baseline": "full_null", "wallclock": True, "overrides": []}}}}
    wallclock = Arm("ablation", "t1__default_null__wallclock", (), {"task": "t1", "arm": "default_null", "run": "wallclock"},
                    "t1__full_null", wallclock_of="t1__default_null")
    assert wallclock_steps(tmp_path, bench, wallclock, 100) == 133


def test_wallclock_steps_of_a_timed_as_arm_need_its_twin_timed(tmp_path: Path) -> None:
    from lcsb_lightning.bench.runner import wallclock_steps
    from lcsb_lightning.bench.spec import Arm

    _timed(tmp_path, "t1", {"full": 3.6})
    bench = {"recipe_speed": {"tasks": ["t1"], "baseline": "full", "arms": {"full": []}},
             "quality": {"arms": {"dyadic_lr": {"timed_as": [["dyadic", None]]}}}}
    wallclock = Arm("quality", "t1__dyadic_lr__wallclock", (), {"task": "t1", "arm": "dyadic_lr", "run": "wallclock"},
                    "t1__full", wallclock_of="t1__dyadic_lr")
    with pytest.raises(RuntimeError, match="needs the speed-up of 'dyadic' on 't1' from the recipe_speed study"):
        wallclock_steps(tmp_path, bench, wallclock, 200)


def test_wallclock_steps_without_recipe_speed_use_the_recorded_mean_step_times(tmp_path: Path) -> None:
    from lcsb_lightning.bench.runner import wallclock_steps
    from lcsb_lightning.bench.spec import Arm

    def recorded(name: str, per_step: list[float]) -> None:
        cumulative = [sum(per_step[: i + 1]) for i in range(len(per_step))]
        folder = tmp_path / "quality" / name
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps(
            {"curves": {"train_seconds": cumulative, "total_train_seconds": cumulative[-1]}}))

    recorded("t1__full", [9.0] + [2.0] * 199)  # 400 s by its means (the first step, a warm-up, does not count)
    recorded("t1__freeze", [2.0] * 100 + [1.0] * 100)  # 300 s; its second epoch (replayed) takes 1 s a step
    # the recipe_speed study is configured (as in benchmark=time_to_quality) but not run
    bench = {"studies": ["quality"], "recipe_speed": {"tasks": ["t1"], "baseline": "full", "arms": {"full": []}},
             "quality": {"steps_per_epoch": 100, "arms": {"freeze": {"baseline": "full", "wallclock": True, "overrides": []}}}}
    wallclock = Arm("quality", "t1__freeze__wallclock", (), {"task": "t1", "arm": "freeze", "run": "wallclock"},
                    "t1__full", wallclock_of="t1__freeze")
    assert wallclock_steps(tmp_path, bench, wallclock, 200) == 300


@pytest.mark.parametrize("name", ["multi_epoch", "multi_epoch_int4", "time_to_quality"])
def test_each_task_of_a_preset_runs_alone_with_one_override(name: str) -> None:
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        tasks = list(compose(config_name="benchmark", overrides=[f"benchmark={name}"]).benchmark.quality.task_overrides)
        assert tasks, f"benchmark={name} has no task_overrides"
        for task in tasks:
            bench = compose(config_name="benchmark", overrides=[f"benchmark={name}", f"benchmark.quality.tasks=[{task}]"]).benchmark
            studies = validate(dict(bench))
            arms = studies["quality"]
            assert {a.labels["task"] for a in arms} == {task}
            if name == "multi_epoch_int4":  # its wall-clock axis times the same task
                assert [a.labels["task"] for a in studies["recipe_speed"]] == [task]
            for arm in arms:
                compose(config_name="config", overrides=["data_dir=/data", *arm.overrides])


# ------------------------------------------------------------------ recipe-loop step time over whole cycles
def _steps(*totals: float) -> list[dict[str, float]]:
    return [{"total": t, "backward": t / 2} for t in totals]


DYADIC_CYCLE = _steps(3.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0)  # depths N, N/8, N/4, N/8, N/2, ...: one deep step


@pytest.mark.parametrize(
    ("rounds", "expected"),
    [
        ([DYADIC_CYCLE], 1.375),                                   # the cycle's mean; its median step says 1.0
        ([DYADIC_CYCLE, DYADIC_CYCLE, _steps(*[9.0] * 8)], 1.375),  # a disturbed round does not count
        ([_steps(2.0, 4.0), _steps(3.0, 3.0), _steps(1.0, 1.0)], 3.0),
        ([_steps(5.0)], 5.0),
    ],
)
def test_recipe_speed_step_time_is_the_mean_of_whole_cycles_median_over_rounds(rounds: list, expected: float) -> None:
    from lcsb_lightning.bench.recipe_speed import summarize

    summary = summarize(rounds)
    assert summary["total"] == pytest.approx(expected)
    assert summary["backward"] == pytest.approx(expected / 2)


def test_recipe_speed_phases_missing_from_some_steps_average_over_the_others() -> None:
    from lcsb_lightning.bench.recipe_speed import summarize

    first_round = [{"total": 2.0}, {"total": 2.0, "between": 0.5}]  # the first timed step has no "between"
    assert summarize([first_round, [{"total": 4.0, "between": 0.1}]]) == {"between": pytest.approx(0.3), "total": 3.0}


@pytest.mark.parametrize(
    ("policies", "steps_per_round", "match"),
    [
        ({"full": "full", "dyadic": "dyadic"}, 8, None),
        ({"full": "full", "dyadic": "dyadic"}, 16, None),
        ({"dyadic3": {"levels": 3}, "none": None}, 4, None),
        ({"random": "random"}, 3, None),                           # no fixed cycle: nothing to cover
        ({"dyadic": "dyadic"}, 7, r"`steps_per_round=7` does not cover whole cycles of arm 'dyadic'.*every 4.*"
                                   r"Allowed: a multiple of 4\.$"),
        ({"dyadic4": {"levels": 4}}, 4, r"arm 'dyadic4'.*every 8.*Allowed: a multiple of 8\.$"),
        ({"full": "full", "dyadic5": {"levels": 5}}, 8, r"arm 'dyadic5'.*repeat every 16"),
        ({"full": "full"}, 0, r"`steps_per_round` must be an integer >= 1, got 0\."),
    ],
)
def test_recipe_speed_rounds_cover_whole_policy_cycles(policies: dict, steps_per_round: int, match: str | None) -> None:
    from lcsb_lightning.bench.recipe_speed import check_whole_cycles
    from lcsb_lightning.policies import build_policy

    def build(spec: Any) -> Any:
        if spec is None:
            return None
        if isinstance(spec, dict):
            return build_policy("dyadic", **spec)
        return build_policy(spec, fraction=0.25) if spec == "random" else build_policy(spec)

    built = {name: build(spec) for name, spec in policies.items()}
    if match is None:
        assert check_whole_cycles(built, steps_per_round) is None
    else:
        with pytest.raises(ValueError, match=match):
            check_whole_cycles(built, steps_per_round)


def test_recipe_speed_refuses_a_cut_cycle_before_building_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from lcsb_lightning.bench import recipe_speed
    from lcsb_lightning.recipes import train

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("the model was built before the arms were checked")

    monkeypatch.setattr(train, "prepare", refuse)
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        def compose_ft(overrides: Any) -> Any:
            return compose(config_name="config", overrides=list(overrides))

        with pytest.raises(ValueError, match="arm 'dyadic'"):
            recipe_speed.time_task("pydoc", {"full": ["policy=full"], "dyadic": ["policy=dyadic"]}, ["model=tiny"],
                                   compose_ft, rounds=1, steps_per_round=6, out_dir="unused")


def test_recipe_speed_times_every_step_of_a_cycle_after_a_warm_up(tmp_path: Path) -> None:
    from lcsb_lightning.bench import recipe_speed

    with finetune_composer() as compose_ft:
        timing = recipe_speed.time_task(
            "pydoc", {"full": ["policy=full"], "dyadic": ["policy=dyadic"]},
            ["model=tiny", "seq_len=32", "task.max_train_examples=64", "trainer.log_every_n_steps=1"],
            compose_ft, rounds=2, steps_per_round=8, out_dir=str(tmp_path))
    for name in ("full", "dyadic"):
        assert [len(steps) for steps in timing["raw"][name]] == [8, 8]  # steps 1-8: one whole dyadic cycle
        means = [sum(s["total"] for s in steps) / 8 for steps in timing["raw"][name]]
        assert timing["arms"][name]["total"] == pytest.approx(sum(means) / 2)


def test_recipe_speed_gives_arms_that_build_different_models_their_own_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QuantizedMeBP compresses the model it trains in place: a float arm timed after an int4 arm on a shared
    model timed the compressed one (a float32 step 2.4x slower in the second round)."""
    from lcsb_lightning.bench import recipe_speed
    from lcsb_lightning.mebp import mebp_state
    from lcsb_lightning.recipes import train

    prepared: list[Any] = []
    real_prepare = train.prepare

    def recording_prepare(cfg: Any) -> Any:
        prepared.append(real_prepare(cfg))
        return prepared[-1]

    monkeypatch.setattr(train, "prepare", recording_prepare)
    with finetune_composer() as compose_ft:
        recipe_speed.time_task(
            "pydoc", {"float": ["policy=full"], "int4": ["policy=full", "mebp=int4"], "dyadic": ["policy=dyadic"]},
            ["model=tiny", "seq_len=32", "task.max_train_examples=64"],
            compose_ft, rounds=2, steps_per_round=4, out_dir=str(tmp_path))
    assert [mebp_state(p.module) is None for p in prepared] == [True, False]  # float and dyadic share one model


def test_a_fresh_process_arm_reports_its_own_whole_process_peak(tmp_path: Path) -> None:
    """``fresh_process: true``: the arm runs in a new process, whose peak RSS is the arm's alone (two arms in one
    process would report the largest peak so far for the second)."""
    from lcsb_lightning.bench.finetune_arm import arm_config, run_finetune_arm_in_fresh_process
    from lcsb_lightning.bench.spec import RESULT_NAME, Arm

    arm = Arm("quality", "pydoc__full", ("model=tiny", "task=pydoc", "policy=full", "seq_len=32",
                                         "task.max_train_examples=16", "task.max_eval_examples=4", "logger=csv"),
              {"task": "pydoc", "arm": "full", "run": "steps"})
    with finetune_composer() as compose_ft:
        cfg = arm_config(arm, compose_ft, steps=2)
    result = run_finetune_arm_in_fresh_process(arm, tmp_path / "arm", cfg, 2, [1])
    assert result == json.loads((tmp_path / "arm" / RESULT_NAME).read_text())
    assert result["fresh_process"] is True and result["steps"] == 2 and "1" in result["eval_at_steps"]
    peak = result["summary"]["peak_rss_mb"]
    assert 50 < peak < 4096  # a whole process: the interpreter, torch and the tiny model


def test_fresh_process_must_be_a_bool() -> None:
    bench = {"name": "q", "studies": ["quality"], "quality": {**QUALITY, "fresh_process": "yes"}}
    with pytest.raises(ValueError, match="benchmark.quality.fresh_process must be true or false, got 'yes'"):
        validate(bench)
