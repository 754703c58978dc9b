"""The standard benchmark configuration end to end on the tiny model (slow: minutes on 2 CPU cores)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_module

from lcsb_lightning.bench.runner import run_benchmark
from lcsb_lightning.recipes.cli import CONFIG_MODULE

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SHARED_DATA / "wikitext-2").is_dir(), reason=f"no shared data at {SHARED_DATA}"),
]


def standard_on_tiny(bench: Any) -> Any:
    """``benchmark=standard`` shrunk: the tiny model (byte tokenizer), SST-2 and WikiText-2, a few steps."""
    bench.name = "standard-tiny"
    tasks = ["wikitext2", "sst2"]
    overrides = {"wikitext2": ["seq_len=32", "task.max_chars=20000", "task.max_eval_examples=4", "task.train_files=[wikitext-2/valid.txt]"],
                 "sst2": ["seq_len=128", "task.max_train_examples=50", "task.max_eval_examples=8"]}
    for study in (bench.recipe_speed, bench.quality):
        study.model, study.tasks, study.common, study.task_overrides = "tiny", tasks, [], overrides
    bench.recipe_speed.rounds, bench.recipe_speed.steps_per_round = 1, 8  # one dyadic cycle
    bench.quality.steps, bench.quality.eval_every, bench.quality.probe_every = 6, 3, 2
    return bench


def test_standard_benchmark_on_the_tiny_model_then_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        bench = standard_on_tiny(compose(config_name="benchmark", overrides=["benchmark=standard"]).benchmark)

        def compose_ft(overrides: Any) -> Any:
            return compose(config_name="config", overrides=[f"data_dir={SHARED_DATA}", *overrides])

        tables = run_benchmark(bench, tmp_path, compose_ft, command="t")
        quality = tables["quality"]
        assert len(quality) == 2 * (1 + 2 * 3)  # full, and three arms at equal steps and at equal wall-clock
        assert {r["metric_name"] for r in quality} == {"ppl", "accuracy"}
        for row in (r for r in quality if r["run"] == "wallclock"):
            equal_steps = next(r for r in quality if (r["task"], r["arm"], r["run"]) == (row["task"], row["arm"], "steps"))
            assert row["steps"] == max(6, round(6 * row["speedup"])) and row["speedup"] == equal_steps["speedup"]
        assert {r["arm"] for r in tables["recipe_speed"]} == {"full", "paper", "truncated", "dyadic"}
        assert tables["quality_probes"]
        md = (tmp_path / "results.md").read_text()
        for heading in ("## Speed in the recipe's own training loop", "## Quality", "### Gradient alignment over training"):
            assert heading in md
        assert len(list((tmp_path / "plots").glob("*.png"))) == 4
        before = json.loads((tmp_path / "results.json").read_text())

        from lcsb_lightning.bench import recipe_speed, runner
        from lcsb_lightning.recipes import train

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("resume ran a finished arm again")

        monkeypatch.setattr(runner, "run_finetune_arm", refuse)
        monkeypatch.setattr(train, "run_finetune", refuse)
        monkeypatch.setattr(recipe_speed, "time_task", refuse)
        again = run_benchmark(bench, tmp_path, compose_ft, command="t")  # every arm finished: nothing runs
        assert again["quality"] == before["quality"] and again["recipe_speed"] == before["recipe_speed"]
