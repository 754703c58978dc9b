"""The step-cost model study (benchmark=cost_model): the fit, the projection, the arms, a smoke run on the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from _recipes_utils import finetune_composer
from hydra import compose, initialize_config_module

from lcsb_lightning.bench import cost_model
from lcsb_lightning.bench.runner import run_benchmark
from lcsb_lightning.recipes import CONFIG_MODULE

DEPTHS = {"d0.125": 0.125, "d0.25": 0.25, "d0.5": 0.5, "full": 1.0}


def _step(t_full: float, a: float, b: float, d: float, shares: dict[str, float]) -> dict[str, float]:
    """A PhaseTimer row of a step that costs ``t_full (a + b d)``: the constant over the phases by ``shares``,
    the depth's part in the backward."""
    const = {k: t_full * a * v for k, v in shares.items()}
    row = {"forward": const["forward"] + const["head"], "lm_head_and_loss": const["head"],
           "backward": const["backward"] + t_full * b * d, "optimizer": const["optimizer"],
           "zero_grad": const["rest"] / 2, "between": const["rest"] / 2, "before_step": 0.0, "clip": 0.0}
    return {**row, "total": t_full * (a + b * d)}


SHARES = {"forward": 0.6, "head": 0.2, "backward": 0.05, "optimizer": 0.1, "rest": 0.05}


@pytest.mark.parametrize(("a_rounds", "t_full"), [
    ([0.47, 0.47, 0.47], 3.7),       # the docs' SmolLM2-135M int4 line
    ([0.2, 0.25, 0.3], 40.0),        # a larger shape; a constant that drifts from round to round
    ([0.6, 0.6], 0.5),               # two rounds
])
def test_the_fit_recovers_a_and_b_and_splits_the_constant(a_rounds: list[float], t_full: float) -> None:
    # every round its own t_full (a drifting machine): the ratio to the round's full step is what is fitted
    raw = {name: [[_step(t_full * (1 + i), a, 1 - a, d, SHARES)] * 2 for i, a in enumerate(a_rounds)]
           for name, d in DEPTHS.items()}
    fit = cost_model.fit_cost(raw, DEPTHS)
    assert fit["a_rounds"] == pytest.approx(a_rounds) and fit["b_rounds"] == pytest.approx([1 - a for a in a_rounds])
    mean_a = sum(a_rounds) / len(a_rounds)
    assert fit["a"] == pytest.approx(mean_a) and fit["b"] == pytest.approx(1 - mean_a)
    assert fit["a_spread"] == pytest.approx(max(a_rounds) - min(a_rounds))
    assert fit["full_s"] == pytest.approx(t_full * (1 + (len(a_rounds) - 1) / 2))
    expected = {"forward": 0.6, "lm_head_and_loss": 0.2, "backward": 0.05, "optimizer": 0.1, "rest": 0.05}
    assert fit["split"] == pytest.approx({k: mean_a * v for k, v in expected.items()})
    assert sum(fit["split"].values()) == pytest.approx(fit["a"])


def test_the_fit_refuses_a_study_without_full_backprop_or_two_depths() -> None:
    step = _step(1.0, 0.5, 0.5, 1.0, SHARES)
    with pytest.raises(ValueError, match="needs the arm 'full'"):
        cost_model.fit_cost({"d0.5": [[step]]}, {"d0.5": 0.5})
    with pytest.raises(ValueError, match="two or more distinct depths"):
        cost_model.fit_cost({"full": [[step]], "d1": [[step]]}, {"full": 1.0, "d1": 1.0})
    with pytest.raises(ValueError, match="same number of rounds"):
        cost_model.fit_cost({"full": [[step], [step]], "d0.5": [[step]]}, {"full": 1.0, "d0.5": 0.5})


@pytest.mark.parametrize(("fraction", "blocks", "depth"), [
    (0.125, 30, 4 / 30), (0.25, 30, 8 / 30), (0.5, 30, 0.5), (0.125, 24, 0.125), (0.125, 4, 0.25), (None, 28, 1.0),
])
def test_the_fit_uses_the_depth_the_policy_realizes(fraction: float | None, blocks: int, depth: float) -> None:
    overrides = ["policy=full"] if fraction is None else cost_model.depth_arms([fraction])[f"d{fraction:g}"]
    assert cost_model.realized_depth(overrides, blocks) == pytest.approx(depth)


def test_depth_arms_are_top_only_with_the_exact_backward_and_full_backprop() -> None:
    assert cost_model.depth_arms([0.5, 0.125, 1.0]) == {
        "d0.125": ["policy=top_only", "policy.fraction=0.125", "lcsb.backward=all_reached"],
        "d0.5": ["policy=top_only", "policy.fraction=0.5", "lcsb.backward=all_reached"], "full": ["policy=full"]}
    with pytest.raises(ValueError, match=r"`depths` must be .* in \(0, 1\], got \[0.5, 0\]"):
        cost_model.depth_arms([0.5, 0])


@pytest.mark.parametrize(("a", "b", "s", "d", "expected"), [
    (0.47, 0.53, 1.0, 1.0, 1.0),             # full backprop against itself
    (0.47, 0.53, 1.25, 0.5, 0.91875),        # 3 levels on SmolLM2-135M int4: pays
    (0.47, 0.53, 1.90, 0.3125, 1.2076875),   # 4 levels at its worst: does not
    (0.1, 0.9, 1.57, 0.3125, 0.5985625),     # a small constant: below 0.8x
])
def test_projected_ratio(a: float, b: float, s: float, d: float, expected: float) -> None:
    assert cost_model.projected_ratio(a, b, s, d) == pytest.approx(expected)


@pytest.mark.parametrize(("params", "ratios", "target", "expected"), [
    ([1e8, 1e9], [1.2, 0.8], 1.0, math.sqrt(1e17)),        # halfway in log(params)
    ([1e9, 1e8], [0.8, 1.2], 1.0, math.sqrt(1e17)),        # any order
    ([1e8, 1e9, 1e10], [1.3, 1.1, 0.9], 1.0, math.sqrt(1e19)),
    ([1e8, 1e9], [0.9, 0.7], 1.0, 1e8),                    # the smallest shape already
    ([1e8, 1e9], [1.2, 1.1], 1.0, None),                   # never
    ([1e8, 1e9], [1.2, 1.0], 1.0, 1e9),                    # exactly at a shape
    ([], [], 1.0, None),
])
def test_break_even_interpolates_in_log_params(params: list[float], ratios: list[float], target: float,
                                               expected: float | None) -> None:
    got = cost_model.break_even(params, ratios, target)
    assert got == (None if expected is None else pytest.approx(expected, rel=1e-9))


def test_projection_rows_per_pipeline_policy_and_steps_ratio() -> None:
    table = [{"shape": "s", "params": 1e8, "pipeline": "int4", "a": 0.5, "b": 0.5},
             {"shape": "l", "params": 1e9, "pipeline": "int4", "a": 0.1, "b": 0.9}]
    rows = cost_model.projection_rows(table, {"targets": [1.0, 0.8], "policies": {"p": {"depth": 0.5, "steps_ratio": [1.2, 1.5]}}})
    assert [(r["policy"], r["steps_ratio"]) for r in rows] == [("p", 1.2), ("p", 1.5)]
    assert rows[0]["ratios"] == pytest.approx({"s": 0.9, "l": 0.66})
    assert rows[0]["break_even"] == {"1": 1e8, "0.8": pytest.approx(10 ** (8 + (0.9 - 0.8) / (0.9 - 0.66)), rel=1e-9)}
    assert rows[1]["break_even"] == {"1": pytest.approx(10 ** (8 + (1.125 - 1) / (1.125 - 0.825)), rel=1e-9), "0.8": None}


@pytest.mark.parametrize(("change", "match"), [
    ({"pipelines": ["int8"]}, r"pipelines must name mebp options, got \['int8'\]; allowed: \['auto', 'int4', 'nf4', 'none'\]"),
    ({"rounds": 0}, "`benchmark.cost_model.rounds` must be an integer >= 1, got 0"),
    ({"steps_per_round": {"other": 2}}, "steps_per_round \\(of .tiny.; a mapping needs the shape or .default.\\). must be an integer >= 1, got None"),
    ({"depths": [2.0]}, r"in \(0, 1\], got \[2.0\]"),
])
def test_the_study_refuses_bad_settings_before_any_work(change: dict, match: str) -> None:
    c = {"shapes": ["tiny"], "pipelines": ["none"], "depths": [0.5], "rounds": 1, "steps_per_round": 1, **change}
    with pytest.raises(ValueError, match=match):
        cost_model.arms(c)


def test_steps_per_round_per_shape_with_a_default() -> None:
    c = {"steps_per_round": {"default": 2, "big": 1}}
    assert (cost_model.steps_per_round(c, "big"), cost_model.steps_per_round(c, "small")) == (1, 2)


def test_the_preset_expands_to_every_shape_and_pipeline_and_takes_overrides() -> None:
    from lcsb_lightning.bench.runner import validate

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        bench = compose(config_name="benchmark", overrides=["benchmark=cost_model"]).benchmark
        assert len(validate(dict(bench))["cost_model"]) == 8
        one = compose(config_name="benchmark", overrides=["benchmark=cost_model", "benchmark.cost_model.shapes=[qwen2.5_0.5b]",
                                                          "benchmark.cost_model.pipelines=[int4]"]).benchmark
        assert [a.name for a in validate(dict(one))["cost_model"]] == ["qwen2.5_0.5b__int4"]


def _intercepts(result: dict) -> list[float]:
    """Each round's ``a``, recomputed from the recorded steps: numpy's line through (depth, mean step / full's)."""
    raw, depths = result["timing"]["raw"], result["depths"]
    mean = {arm: [np.mean([s["total"] for s in steps]) for steps in rounds] for arm, rounds in raw.items()}
    return [float(np.polyfit([depths[arm] for arm in raw], [mean[arm][i] / mean["full"][i] for arm in raw], 1)[1])
            for i in range(len(mean["full"]))]


def test_a_smoke_run_on_the_tiny_model_writes_the_table_projection_and_plot(tmp_path: Path) -> None:
    bench = {"name": "cost", "studies": ["cost_model"], "cost_model": {
        "shapes": ["tiny"], "pipelines": ["none", "int4"], "depths": [0.25, 0.5], "task": "pydoc", "rounds": 2,
        "steps_per_round": 1, "common": ["guard=none", "seq_len=32", "task.max_train_examples=16",
                                          "keep_activations=null", "module.chunked_loss=false"],  # as cost_model.yaml
        "projection": {"targets": [1.0, 0.8], "policies": {"dyadic_l3": {"depth": 0.5, "steps_ratio": [1.25]}}}}}
    with finetune_composer() as compose_ft:
        tables = run_benchmark(bench, tmp_path, compose_ft, command="test")
    rows = tables["cost_model"]
    assert [(r["shape"], r["pipeline"], r["num_blocks"]) for r in rows] == [("tiny", "float32", 4), ("tiny", "int4", 4)]
    for r, pipeline in zip(rows, ["none", "int4"]):
        result = json.loads((tmp_path / "cost_model" / f"tiny__{pipeline}" / "result.json").read_text())
        a_rounds = _intercepts(result)  # the two rounds' own timings: a spread the fit has to compute
        assert (r["a_min"], r["a_max"]) == pytest.approx((min(a_rounds), max(a_rounds)))
        assert r["a_spread"] == pytest.approx(max(a_rounds) - min(a_rounds))
        assert sum(r["split"].values()) == pytest.approx(r["a"])
    assert result["depths"] == {"d0.25": 0.25, "d0.5": 0.5, "full": 1.0}
    raw = result["timing"]["raw"]
    assert [[len(steps) for steps in rounds] for rounds in raw.values()] == [[1, 1]] * 3  # one timed step a round
    # every arm, the first included: the head's hooks fire after QuantizedMeBP has converted the model
    assert all(0 < s["lm_head_and_loss"] < s["forward"] for rounds in raw.values() for steps in rounds for s in steps)
    assert len(tables["cost_model_projection"]) == 2
    md = (tmp_path / "results.md").read_text()
    assert "### Projection (on paper, not measured)" in md and "| tiny | " in md
    assert (tmp_path / "plots" / "cost_model_constant.png").stat().st_size > 1000


def test_a_pretrained_model_is_refused_before_any_timing(tmp_path: Path) -> None:
    bench = {"name": "cost", "studies": ["cost_model"], "cost_model": {
        "shapes": ["smollm2_135m"], "pipelines": ["none"], "depths": [0.5], "task": "pydoc", "rounds": 1, "steps_per_round": 1}}
    with finetune_composer() as compose_ft:
        with pytest.raises(ValueError, match="'smollm2_135m' is no random-init shape.*allowed: e.g. smollm2_135m_random"):
            run_benchmark(bench, tmp_path, compose_ft, command="test")
