"""Time to quality: crossing times interpolated between evaluations, ratios to full backprop, the
equal-wall-clock loss, and the section that leads results.md."""

from __future__ import annotations

from typing import Any

import pytest

from lcsb_lightning.bench import report
from lcsb_lightning.bench.runner import validate
from lcsb_lightning.bench.time_to_quality import eval_curve, loss_at, reach, time_to_quality_rows


def _result(name: str, arm: str, losses: dict[int, float], seconds_per_step: float, baseline: str | None = "full",
            run: str = "steps", wallclock_of: str | None = None) -> dict[str, Any]:
    last = max(losses)
    return {
        "name": name, "labels": {"task": "wikitext2", "arm": arm, "run": run}, "baseline": baseline,
        "wallclock_of": wallclock_of, "steps": last, "summary": {"steps": last}, "diverged": False,
        "eval_at_steps": {str(s): {"val/loss": v} for s, v in losses.items()},
        "curves": {"steps": list(range(1, last + 1)), "train_loss": [1.0] * last,
                   "train_seconds": [seconds_per_step * s for s in range(1, last + 1)],
                   "evals": [{"step": s, "train_seconds": seconds_per_step * s} for s in losses if 0 < s < last],
                   "total_train_seconds": seconds_per_step * last},
    }


FULL = _result("full", "full", {0: 4.0, 25: 3.0, 50: 2.5, 75: 2.2, 100: 2.0}, 2.0, baseline=None)
# slower per step to learn, but 2x cheaper steps
FAST = _result("fast", "fast", {0: 4.0, 25: 3.4, 50: 3.0, 75: 2.6, 100: 2.3, 125: 2.15}, 1.0)
FAST_WALLCLOCK = _result("fast_wc", "fast", {0: 4.0, 100: 2.4, 200: 2.1}, 1.0, run="wallclock", wallclock_of="fast")
NEVER = _result("never", "never", {0: 4.0, 50: 3.5, 100: 3.3}, 1.0)


def test_reach_interpolates_between_evaluations_and_returns_none_when_never_reached() -> None:
    curve = eval_curve(FULL)
    assert curve[0] == (0, 0.0, 4.0) and curve[-1] == (100, 200.0, 2.0)
    assert reach(curve, 2.2) == (75.0, 150.0)
    step, seconds = reach(curve, 2.75)  # halfway between steps 25 and 50
    assert step == pytest.approx(37.5) and seconds == pytest.approx(75.0)
    assert reach(curve, 1.9) is None
    assert loss_at(curve, 75.0) == pytest.approx(2.75)
    assert loss_at(curve, 250.0) is None


def test_rows_give_the_ratio_to_full_and_the_loss_at_full_wallclock() -> None:
    rows = {r["arm"]: r for r in time_to_quality_rows([FULL, FAST, FAST_WALLCLOCK, NEVER])}
    assert set(rows) == {"full", "fast", "never"}  # the wall-clock twin is not a row of its own
    # target: 4.0 - 0.9 * (4.0 - 2.0) = 2.2; full reaches it at step 75 = 150 s
    assert rows["full"]["target_loss"] == pytest.approx(2.2)
    assert rows["full"]["reach_seconds"] == pytest.approx(150.0) and rows["full"]["ratio_to_full"] == pytest.approx(1.0)
    # fast: 2.3 at step 100, 2.15 at 125 -> 2.2 at step 100 + 25 * (0.1 / 0.15) = 116.67 -> 116.67 s at 1 s/step
    assert rows["fast"]["reach_step"] == pytest.approx(116.6667, rel=1e-4)
    assert rows["fast"]["ratio_to_full"] == pytest.approx(116.6667 / 150.0, rel=1e-4)
    assert rows["fast"]["loss_at_full_wallclock"] == pytest.approx(2.1)
    assert rows["fast"]["at_full_wallclock_from"] == "own schedule"
    assert rows["never"]["reach_seconds"] is None and rows["never"]["ratio_to_full"] is None
    assert rows["never"]["at_full_wallclock_from"] == "equal-steps curve"
    assert rows["never"]["loss_at_full_wallclock"] is None  # its curve ends at 100 s, before full's 200 s


def test_an_arm_that_reaches_the_target_only_in_its_wall_clock_run_is_timed_there() -> None:
    slow = _result("slow", "slow", {0: 4.0, 50: 3.0, 100: 2.5}, 1.0)  # target 2.2 not reached in 100 steps
    slow_wallclock = _result("slow_wc", "slow", {0: 4.0, 100: 2.6, 150: 2.3, 200: 2.1}, 1.0, run="wallclock",
                             wallclock_of="slow")
    rows = {r["arm"]: r for r in time_to_quality_rows([FULL, FAST, FAST_WALLCLOCK, slow, slow_wallclock, NEVER])}
    # 2.3 at step 150, 2.1 at 200 -> 2.2 at step 175 = 175 s, against full's 150 s
    assert rows["slow"]["reach_step"] == pytest.approx(175.0) and rows["slow"]["reach_seconds"] == pytest.approx(175.0)
    assert rows["slow"]["ratio_to_full"] == pytest.approx(175.0 / 150.0)
    assert rows["slow"]["reached_in"] == "own schedule"
    assert rows["fast"]["reached_in"] == "equal steps"  # reached there first: its twin is not asked
    assert rows["never"]["reached_in"] is None
    text = report.markdown({"time_to_quality": list(rows.values())}, {"name": "t"})
    assert "| 175 | 175 | **1.17x** |" in text and "own schedule" in text


def test_the_ratio_splits_into_more_steps_times_cheaper_steps() -> None:
    rows = {r["arm"]: r for r in time_to_quality_rows([FULL, FAST, NEVER])}
    # full reaches 2.2 at step 75, fast at 116.67: 1.56x the steps at half the step time = 0.78x the time
    assert rows["full"]["steps_ratio"] == pytest.approx(1.0) and rows["full"]["step_time_ratio"] == pytest.approx(1.0)
    assert rows["fast"]["steps_ratio"] == pytest.approx(116.6667 / 75.0, rel=1e-4)
    assert rows["fast"]["step_time_ratio"] == pytest.approx(0.5)
    assert rows["fast"]["steps_ratio"] * rows["fast"]["step_time_ratio"] == pytest.approx(rows["fast"]["ratio_to_full"])
    assert rows["never"]["steps_ratio"] is None and rows["never"]["step_time_ratio"] is None
    text = report.markdown({"time_to_quality": list(rows.values())}, {"name": "t"})
    assert "| 1.56x | 0.50x |" in text


def test_a_phased_arms_step_time_ratio_is_its_mean_up_to_the_target() -> None:
    from lcsb_lightning.bench.time_to_quality import PhasedStepTime

    switch = _result("switch", "switch", {0: 4.0, 25: 3.4, 50: 3.0, 75: 2.4, 100: 2.1}, 1.0)
    times = {("wikitext2", "full"): 2.0, ("wikitext2", "switch"): PhasedStepTime(((50, 1.0), (None, 2.0)))}
    row = {r["arm"]: r for r in time_to_quality_rows([FULL, switch], times)}["switch"]
    # 91.67 steps to the target in 133.3 s: 0.727 of full backprop's 2 s a step on average
    assert row["steps_ratio"] == pytest.approx(91.6667 / 75.0, rel=1e-4)
    assert row["step_time_ratio"] == pytest.approx((50 + 2 * 41.6667) / 91.6667 / 2.0, rel=1e-4)


def test_recipe_loop_step_times_replace_the_recorded_ones() -> None:
    rows = {r["arm"]: r for r in time_to_quality_rows([FULL, FAST], {("wikitext2", "full"): 1.0, ("wikitext2", "fast"): 1.0})}
    assert rows["full"]["reach_seconds"] == pytest.approx(75.0)
    assert rows["fast"]["ratio_to_full"] == pytest.approx(116.6667 / 75.0, rel=1e-4)


def test_time_to_quality_leads_results_md() -> None:
    rows = time_to_quality_rows([FULL, FAST, FAST_WALLCLOCK])
    text = report.markdown({"time_to_quality": rows, "quality": report.finetune_rows([FULL, FAST], {})}, {"name": "t"})
    assert text.index("## Time to quality") < text.index("## Quality")
    assert "**0.78x**" in text


@pytest.mark.parametrize("share", [0, 1.5, "x"])
def test_bad_target_share_is_refused_before_any_run(share: Any) -> None:
    bench = {"studies": ["quality"], "quality": {"model": "tiny", "tasks": ["pydoc"], "seed": 0, "steps": 2,
                                                  "target_share": share, "arms": {"full": {"overrides": []}}}}
    with pytest.raises(ValueError, match="target_share must be in"):
        validate(bench)
    with pytest.raises(ValueError, match="`share` must be in"):
        time_to_quality_rows([FULL], share=share if isinstance(share, (int, float)) else -1)


def test_ratios_at_other_targets_show_an_early_lead_and_a_late_loss() -> None:
    from lcsb_lightning.bench.time_to_quality import ratios_by_share

    rows = {r["arm"]: r["ratios"] for r in ratios_by_share([FULL, FAST, FAST_WALLCLOCK, NEVER], None, [0.5, 0.9])}
    assert set(rows) == {"full", "fast", "never"}
    assert rows["full"] == {0.5: pytest.approx(1.0), 0.9: pytest.approx(1.0)}
    # target 3.0 at 50%: full at step 25 (50 s), fast at step 50 (50 s); 90%: 116.67 s against 150 s
    assert rows["fast"][0.5] == pytest.approx(1.0) and rows["fast"][0.9] == pytest.approx(116.6667 / 150.0, rel=1e-4)
    assert rows["never"] == {0.5: None, 0.9: None}  # it ends at 3.3
    text = report.markdown({"time_to_quality": time_to_quality_rows([FULL, FAST]),
                            "time_to_quality_by_share": ratios_by_share([FULL, FAST], None, [0.5, 0.9])}, {"name": "t"})
    assert "### Time to quality at other targets" in text and "| wikitext2 | fast | 1.00x | 0.78x |" in text


@pytest.mark.parametrize("shares", [[0.5, 0], [1.2], ["x"], [True]])
def test_bad_other_shares_are_refused_before_any_run(shares: list[Any]) -> None:
    bench = {"studies": ["quality"], "quality": {"model": "tiny", "tasks": ["pydoc"], "seed": 0, "steps": 2,
                                                  "other_shares": shares, "arms": {"full": {"overrides": []}}}}
    with pytest.raises(ValueError, match="other_shares must be shares in"):
        validate(bench)


def test_a_timed_as_arm_costs_its_twins_step_time() -> None:
    from lcsb_lightning.bench.time_to_quality import timed_as_step_times

    arms = {"fast_lr": {"timed_as": [["fast", None]]}, "fast": {}}
    times = timed_as_step_times(arms, {("wikitext2", "fast"): 1.0, ("wikitext2", "full"): 2.0, ("gsm8k", "full"): 3.0})
    assert times == {("wikitext2", "fast_lr"): 1.0}  # gsm8k lacks "fast"
    fast_lr = _result("fast_lr", "fast_lr", {0: 4.0, 25: 3.4, 50: 3.0, 75: 2.4, 100: 2.1}, 1.0)
    rows = {r["arm"]: r for r in time_to_quality_rows([FULL, fast_lr], {("wikitext2", "full"): 2.0, **times})}
    # target 2.2 at step 75 + 25 * (0.2 / 0.3) = 91.67, at 1 s a step, against full's 150 s
    assert rows["fast_lr"]["reach_seconds"] == pytest.approx(91.6667, rel=1e-4)
    assert rows["fast_lr"]["seconds_per_step"] == pytest.approx(1.0)


@pytest.mark.parametrize(("timed_as", "match"), [
    ([["fast", 50]], "timed_as must be"),
    ([["fast", None], ["full", None]], "timed_as must be"),
    ("fast", "timed_as must be"),
    ([["slow", None]], "names \\['slow'\\], which the recipe_speed study does not time"),
])
def test_bad_timed_as_is_refused_before_any_run(timed_as: Any, match: str) -> None:
    bench = {"studies": ["quality"], "recipe_speed": {"arms": {"fast": [], "full": []}},
             "quality": {"model": "tiny", "tasks": ["pydoc"], "seed": 0, "steps": 2,
                         "arms": {"full": {"overrides": []}, "switch": {"baseline": "full", "overrides": [], "timed_as": timed_as}}}}
    with pytest.raises(ValueError, match=match):
        validate(bench)


@pytest.mark.parametrize(("phases", "seconds", "steps"), [
    (((None, 2.0),), 10.0, 5.0),
    (((60, 1.8), (None, 3.6)), 108.0, 60.0),        # exactly the first phase
    (((60, 1.8), (None, 3.6)), 720.0, 230.0),       # into the open-ended one
    (((10, 1.0), (10, 2.0), (None, 4.0)), 35.0, 21.25),
    (((60, 1.8), (None, 3.6)), 0.0, 0.0),
])
def test_steps_within_inverts_seconds(phases: tuple, seconds: float, steps: float) -> None:
    from lcsb_lightning.bench.time_to_quality import PhasedStepTime

    timed = PhasedStepTime(phases)
    assert timed.steps_within(seconds) == pytest.approx(steps)
    assert timed.seconds(timed.steps_within(seconds)) == pytest.approx(seconds)


def test_a_runs_recorded_step_time_is_its_mean_not_its_median_step() -> None:
    from lcsb_lightning.bench.time_to_quality import recorded_step_time

    cycle = [3.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0]            # a dyadic cycle's one deep step and shallow ones
    per_step = [10.0, *cycle[1:], *cycle * 5]                    # the first step, a warm-up, replaced by 10 s
    times = [sum(per_step[: i + 1]) for i in range(len(per_step))]
    (phase,) = recorded_step_time({"curves": {"train_seconds": times}}).phases
    assert phase == (None, pytest.approx((sum(cycle) * 6 - 3.0) / 47))  # 1.367 s; the median step: 1.0 s


# full backprop at a second learning rate: it ends lower (1.8 against 2.0), so it is the baseline of the sweep
FULL_LR = _result("full_lr", "full_lr", {0: 4.0, 25: 2.8, 50: 2.3, 75: 2.0, 100: 1.8}, 2.0)


def test_with_a_baseline_sweep_every_arm_is_measured_against_the_best_full_backprop() -> None:
    from lcsb_lightning.bench.time_to_quality import best_of_sweep

    swept = best_of_sweep([FULL, FULL_LR, FAST, FAST_WALLCLOCK], ["full_lr"])
    assert [r["baseline"] for r in swept] == ["full_lr", None, "full_lr", "full_lr"]
    assert FULL["baseline"] is None and FAST["baseline"] == "full"  # the inputs are left as they were
    rows = {r["arm"]: r for r in time_to_quality_rows(swept)}
    # target 4.0 - 0.9 * (4.0 - 1.8) = 2.02; full_lr reaches it at step 75 - 25 * (0.02 / 0.3) = 73.33 (146.67 s)
    assert {r["baseline"] for r in rows.values()} == {"full_lr"}
    assert rows["full_lr"]["target_loss"] == pytest.approx(2.02) and rows["full_lr"]["ratio_to_full"] == pytest.approx(1.0)
    assert rows["full_lr"]["reach_seconds"] == pytest.approx(146.6667, rel=1e-4)
    # the other learning rate: 2.2 at step 75, 2.0 at 100 -> step 97.5, 195 s
    assert rows["full"]["ratio_to_full"] == pytest.approx(195.0 / 146.6667, rel=1e-4)
    assert rows["fast"]["reach_seconds"] is None and rows["fast"]["full_final_loss"] == pytest.approx(1.8)
    assert rows["fast"]["loss_at_full_wallclock"] == pytest.approx(2.1)  # its twin, as before
    # without a sweep (or when the baseline ends lowest) nothing changes
    assert best_of_sweep([FULL, FAST], []) == [FULL, FAST]
    worse = _result("full_lr", "full_lr", {0: 4.0, 100: 2.5}, 2.0)
    assert [r["baseline"] for r in best_of_sweep([FULL, worse, FAST], ["full_lr"])] == [None, "full", "full"]
    text = report.markdown({"time_to_quality": list(rows.values())}, {"name": "t"})
    assert "| wikitext2 | fast | full_lr |" in text


@pytest.mark.parametrize("sweep", [["nope"], ["full"]])
def test_a_baseline_sweep_of_arms_without_a_baseline_is_refused_before_any_run(sweep: list[str]) -> None:
    bench = {"studies": ["quality"], "quality": {"model": "tiny", "tasks": ["pydoc"], "seed": 0, "steps": 2,
                                                  "baseline_sweep": sweep,
                                                  "arms": {"full": {"overrides": []},
                                                           "full_lr": {"baseline": "full", "overrides": []}}}}
    with pytest.raises(ValueError, match=f"baseline_sweep names '{sweep[0]}'.*allowed: \\['full_lr'\\]"):
        validate(bench)


def test_a_twin_is_read_at_the_chosen_baselines_wall_clock_and_a_diverged_full_is_never_the_best() -> None:
    from lcsb_lightning.bench.time_to_quality import best_of_sweep

    # the twin was sized to full's 200 s; full_lr, the best, took 180 s: its loss there is read off the twin's curve
    quick = _result("full_lr", "full_lr", {0: 4.0, 25: 2.8, 50: 2.3, 75: 2.0, 90: 1.8}, 2.0)
    rows = {r["arm"]: r for r in time_to_quality_rows(best_of_sweep([FULL, quick, FAST, FAST_WALLCLOCK], ["full_lr"]))}
    assert rows["fast"]["baseline"] == "full_lr"
    assert rows["fast"]["loss_at_full_wallclock"] == pytest.approx(2.4 - 0.3 * 80 / 100)  # at 180 s, not its 200 s
    diverged = _result("full", "full", {0: 4.0, 50: 3.0, 100: float("nan")}, 2.0, baseline=None)
    assert [r["baseline"] for r in best_of_sweep([diverged, FULL_LR], ["full_lr"])] == ["full_lr", None]
