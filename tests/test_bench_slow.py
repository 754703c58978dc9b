"""The short benchmark configuration end to end on the tiny model (slow: minutes on 2 CPU cores)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir

from lcsb_lightning.bench.runner import run_benchmark
from lcsb_lightning.recipes.cli import conf_dir

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SHARED_DATA / "wikitext-2").is_dir(), reason=f"no shared data at {SHARED_DATA}"),
]


def short_on_tiny(bench: Any) -> Any:
    """``benchmark=short`` with the tiny model (byte tokenizer: longer sequences for the same text) and tiny shape."""
    bench.name = "short-tiny"
    bench.quality.model = bench.stability.model = "tiny"
    data = f"data_dir={SHARED_DATA}"
    bench.quality.common = [*bench.quality.common, data, "seq_len=32", "eval_batch_size=8"]
    bench.quality.task_overrides.gsm8k = ["seq_len=512", "task.max_train_examples=50", "task.max_eval_examples=4",
                                          "task.num_generate=1", "task.max_new_tokens=4"]
    bench.quality.task_overrides.sst2 = ["seq_len=128", "task.max_train_examples=50", "task.max_eval_examples=8"]
    bench.stability.common = [*bench.stability.common, data, "seq_len=32", "task.max_eval_examples=4"]
    bench.speed.shapes = ["tiny"]
    bench.speed.seq_len = 32
    return bench


def test_short_benchmark_on_the_tiny_model_then_resume(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        bench = short_on_tiny(compose(config_name="benchmark", overrides=["benchmark=short"]).benchmark)
        tables = run_benchmark(bench, tmp_path, lambda o: compose(config_name="config", overrides=list(o)), command="t")

        quality = tables["quality"]
        assert len(quality) == 3 * len(bench.quality.arms)
        assert {r["metric_name"] for r in quality} == {"ppl", "exact_match", "accuracy"}
        goal = [r for r in quality if r["arm"] == "cyclic_n4_nf4"]
        assert all(r["budget_step"] >= r["steps"] and r["wallclock_delta_pct"] is not None for r in goal)
        speed = {r["arm"]: r for r in tables["speed"]}
        assert speed["full"]["speedup"] == pytest.approx(1.0) and speed["cyclic_n4"]["peak_rss_mb"] > 0
        grid = tables["stability"]
        assert len(grid) == 2 * 2 * 3 and all(c["runs"] == 1 for c in grid)
        md = (tmp_path / "results.md").read_text()
        for heading in ("## Speed and memory", "## Quality at equal steps", "## Quality at equal wall-clock", "## 4-bit stability"):
            assert heading in md
        assert len(list((tmp_path / "plots").glob("*.png"))) == 4
        before = json.loads((tmp_path / "results.json").read_text())

        def no_compose(overrides: Any) -> Any:
            raise AssertionError(f"resume ran a finished arm again: {overrides}")

        again = run_benchmark(bench, tmp_path, no_compose, command="t")  # every arm finished: nothing runs
        assert again["quality"] == before["quality"] and again["stability"] == before["stability"]
