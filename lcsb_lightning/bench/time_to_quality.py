"""Time to quality: when each arm's eval loss reaches a share of full backprop's improvement, against full backprop's
time (pure functions of the arms' results). The target is ``L0 - share * (L0 - L_full)``, reached at the first
evaluation at or below it, interpolated linearly between evaluations; an arm's wall-clock at step ``s`` is ``s`` times
its ``recipe_speed`` step time or, without one, its own recorded step time (:func:`recorded_step_time`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]
Point = tuple[int, float, float]  # (step, train seconds, eval loss)


@dataclass(frozen=True)
class PhasedStepTime:
    """The training wall-clock of an arm whose step time changes during the run: ``phases`` are ``(steps, seconds
    per step)`` in order, the last one open-ended (``steps=None``).

    Example::

        >>> PhasedStepTime(((60, 1.8), (None, 3.5))).seconds(100)
        248.0
        >>> PhasedStepTime(((60, 1.8), (None, 3.5))).steps_within(248.0)
        100.0
    """

    phases: tuple[tuple[int | None, float], ...]

    def steps_within(self, seconds: float) -> float:
        """The (fractional) number of steps that ``seconds`` of training pays for: the inverse of :meth:`seconds`."""
        steps, left = 0.0, float(seconds)
        for length, per_step in self.phases:
            part = left / per_step if length is None else min(left / per_step, float(length))
            steps, left = steps + part, left - part * per_step
            if left <= 0:
                break
        return steps

    def seconds(self, steps: float) -> float:
        total, left = 0.0, float(steps)
        for length, per_step in self.phases:
            part = left if length is None else min(left, float(length))
            total, left = total + part * per_step, left - part
            if left <= 0:
                break
        return total


def recorded_step_time(result: Mapping[str, Any], steps_per_epoch: int | None = None) -> PhasedStepTime:
    """A run's own step time, for runs without a ``recipe_speed`` timing: the mean recorded train seconds per step
    of each epoch of ``steps_per_epoch`` steps (``None``: the whole run), the last one continuing past the run.
    Means, as in the recipe loop's timing; the run's first step, its warm-up, does not count.

    Example::

        >>> run = {"curves": {"train_seconds": [5.0, 7.0, 9.0, 10.0, 11.0, 14.0]}}  # steps of 5, 2, 2 | 1, 1, 3 s
        >>> recorded_step_time(run, steps_per_epoch=3)
        PhasedStepTime(phases=((3, 2.0), (None, 1.6666666666666667)))
        >>> recorded_step_time(run).phases
        ((None, 1.8),)
    """
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(f"`steps_per_epoch={steps_per_epoch}` must be >= 1.")
    times = (0.0, *(float(t) for t in result["curves"]["train_seconds"]))
    durations = [b - a for a, b in zip(times, times[1:])]
    span = steps_per_epoch or len(durations)
    chunks = [durations[i:i + span] for i in range(0, len(durations), span)]
    chunks[0] = chunks[0][1:] or chunks[0]
    means = [statistics.fmean(chunk) for chunk in chunks]
    return PhasedStepTime(tuple((span if i < len(means) - 1 else None, m) for i, m in enumerate(means)))


StepTime = float | PhasedStepTime


def elapsed(per_step: StepTime, steps: float) -> float:
    """Training seconds after ``steps`` optimizer steps at ``per_step`` (seconds, or a phased step time)."""
    return steps * per_step if isinstance(per_step, float) else per_step.seconds(steps)


def steps_within(per_step: StepTime, seconds: float) -> float:
    """The (fractional) optimizer steps that ``seconds`` of training pay for: the inverse of :func:`elapsed`."""
    return seconds / per_step if isinstance(per_step, float) else per_step.steps_within(seconds)


def timed_as_step_times(arms: Mapping[str, Mapping[str, Any]],
                        step_seconds: Mapping[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """``(task, arm) ->`` seconds per step for every quality arm with ``timed_as: [[twin, null]]``: its steps cost
    the recipe-loop step time of ``twin``, an arm with the same step (tasks lacking ``twin`` are left out).

    Example::

        >>> timed_as_step_times({"dyadic_lr": {"timed_as": [["dyadic", None]]}, "full": {}},
        ...                     {("t", "dyadic"): 1.5, ("t", "full"): 3.0})
        {('t', 'dyadic_lr'): 1.5}
    """
    twins = {name: arm["timed_as"][0][0] for name, arm in arms.items() if arm.get("timed_as")}
    return {(task, name): step_seconds[(task, twin)] for name, twin in twins.items()
            for task in {task for task, _ in step_seconds} if (task, twin) in step_seconds}


def eval_curve(result: Mapping[str, Any], per_step: StepTime | None = None) -> list[Point]:
    """``(step, train seconds, eval loss)`` of every evaluation of a run, by step (step 0 included); without
    ``per_step`` the seconds are the recorder's own."""
    curves = result["curves"]
    recorded = {int(e["step"]): float(e["train_seconds"]) for e in curves.get("evals", [])}
    last = max(int(s) for s in result["eval_at_steps"])
    recorded.update({0: 0.0, last: float(curves.get("total_train_seconds") or math.nan)})
    points: list[Point] = []
    for step_text, metrics in result["eval_at_steps"].items():
        loss = (metrics or {}).get("val/loss")
        step = int(step_text)
        if loss is None or (per_step is None and step not in recorded):
            continue
        points.append((step, elapsed(per_step, step) if per_step is not None else recorded[step], float(loss)))
    return sorted(points)


def reach(curve: Sequence[Point], target: float) -> tuple[float, float] | None:
    """``(step, seconds)`` at which the eval loss first reaches ``target``, linearly interpolated between
    the two evaluations around the crossing; ``None`` if it never does.

    Example::

        >>> reach([(0, 0.0, 4.0), (10, 20.0, 3.0), (20, 40.0, 2.0)], 2.5)
        (15.0, 30.0)
        >>> reach([(0, 0.0, 4.0), (10, 20.0, 3.0)], 2.5) is None
        True
    """
    for (s0, t0, l0), (s1, t1, l1) in zip(curve, curve[1:]):
        if l1 <= target < l0:
            fraction = (l0 - target) / (l0 - l1)
            return s0 + fraction * (s1 - s0), t0 + fraction * (t1 - t0)
    if curve and curve[0][2] <= target:
        return float(curve[0][0]), curve[0][1]
    return None


def loss_at(curve: Sequence[Point], seconds: float) -> float | None:
    """The eval loss at training wall-clock ``seconds``, interpolated linearly; ``None`` past the curve."""
    for (_, t0, l0), (_, t1, l1) in zip(curve, curve[1:]):
        if t0 <= seconds <= t1:
            return l0 if t1 == t0 else l0 + (seconds - t0) / (t1 - t0) * (l1 - l0)
    return None


def best_of_sweep(results: Sequence[Mapping[str, Any]], candidates: Sequence[str]) -> list[Row]:
    """``results`` (copied) with each task's baseline the best of a sweep: of the baseline arm and the ``candidates``
    arms (full backprop at other learning rates, say), the equal-steps run with the lowest final eval loss becomes
    every run's baseline in that task.

    Example::

        >>> def run(arm, base, final):
        ...     return {"name": arm, "baseline": base, "labels": {"task": "t", "arm": arm, "run": "steps"},
        ...             "curves": {}, "eval_at_steps": {"0": {"val/loss": 4.0}, "9": {"val/loss": final}}}
        >>> swept = best_of_sweep([run("full", None, 3.0), run("full_lr", "full", 2.8), run("fast", "full", 2.9)],
        ...                       ["full_lr"])
        >>> [(r["name"], r["baseline"]) for r in swept]
        [('full', 'full_lr'), ('full_lr', None), ('fast', 'full_lr')]
    """
    out = [dict(r) for r in results]
    if not candidates:
        return out
    for task in dict.fromkeys(r["labels"]["task"] for r in out):
        runs = [r for r in out if r["labels"]["task"] == task and r["labels"].get("run", "steps") == "steps"]
        base_names = {r["baseline"] for r in runs if r["labels"]["arm"] in candidates and r["baseline"]}

        def in_sweep(r: Mapping[str, Any]) -> bool:
            return r["name"] in base_names or r["labels"]["arm"] in candidates

        finals = [(curve[-1][2], r["name"]) for r in runs
                  if in_sweep(r) and (curve := eval_curve(r, 1.0)) and math.isfinite(curve[-1][2])]
        if not finals:
            continue
        best = min(finals)[1]
        for r in out:
            if r["labels"]["task"] == task and (in_sweep(r) or r["baseline"] in base_names):
                r["baseline"] = None if r["name"] == best else best
    return out


def time_to_quality_rows(
    results: Sequence[Mapping[str, Any]],
    step_seconds: Mapping[tuple[str, str], StepTime] | None = None,
    share: float = 0.9,
) -> list[Row]:
    """One row per task x arm (equal-steps runs): when it reaches ``share`` of full backprop's improvement, as a
    ratio to full backprop's time, and its eval loss at full backprop's wall-clock on its own schedule (its
    ``wallclock`` twin, whose curve also times an arm that misses the target within the equal steps). The ratio is
    ``steps_ratio`` (steps to the target over full backprop's) times ``step_time_ratio`` (mean step time over its).

    Raises:
        ValueError: ``share`` is not in (0, 1].
    """
    if not 0 < share <= 1:
        raise ValueError(f"`share` must be in (0, 1], got {share!r}.")
    step_seconds = step_seconds or {}
    by_name = {r["name"]: r for r in results}
    twins = {r["wallclock_of"]: r for r in results if r.get("wallclock_of")}
    rows: list[Row] = []
    for r in results:
        if r["labels"].get("run", "steps") != "steps":
            continue
        task, arm = r["labels"]["task"], r["labels"]["arm"]
        base = by_name.get(r["baseline"] or r["name"])
        if base is None:
            continue
        base_curve = eval_curve(base, step_seconds.get((task, base["labels"]["arm"])))
        curve = eval_curve(r, step_seconds.get((task, arm)))
        if len(base_curve) < 2 or len(curve) < 2:
            continue
        initial, full_final, full_seconds = base_curve[0][2], base_curve[-1][2], base_curve[-1][1]
        target = initial - share * (initial - full_final)
        twin = twins.get(r["name"])
        twin_curve = eval_curve(twin, step_seconds.get((task, arm))) if twin is not None else []
        base_reach, arm_reach, reached_in = reach(base_curve, target), reach(curve, target), "equal steps"
        if arm_reach is None and twin_curve:  # not within the equal steps: within full backprop's wall-clock?
            arm_reach, reached_in = reach(twin_curve, target), "own schedule"
        rows.append({
            "task": task, "arm": arm, "baseline": base["labels"]["arm"], "share": share,
            "initial_loss": initial, "target_loss": target, "final_loss": curve[-1][2], "steps": curve[-1][0],
            "seconds_per_step": _mean_step_seconds(step_seconds.get((task, arm)), curve[-1][0]),
            "reach_step": None if arm_reach is None else arm_reach[0],
            "reach_seconds": None if arm_reach is None else arm_reach[1],
            "reached_in": None if arm_reach is None else reached_in,
            "ratio_to_full": (arm_reach[1] / base_reach[1]) if arm_reach and base_reach and base_reach[1] > 0 else None,
            **_ratio_factors(arm_reach, base_reach),
            "loss_at_full_wallclock": _twin_loss_at(twin_curve, full_seconds) if twin_curve else (
                full_final if r["name"] == base["name"] else loss_at(curve, full_seconds)),
            "at_full_wallclock_from": "own schedule" if twin_curve or r["name"] == base["name"] else "equal-steps curve",
            "full_final_loss": full_final,
            "eval_points": len(curve),
        })
    return rows


def _twin_loss_at(twin_curve: Sequence[Point], seconds: float) -> float:
    # a baseline chosen by best_of_sweep may have taken a little less time than the one the twin was sized to
    at = loss_at(twin_curve, seconds)
    return twin_curve[-1][2] if at is None else at


def _ratio_factors(arm_reach: tuple[float, float] | None, base_reach: tuple[float, float] | None) -> Row:
    if not arm_reach or not base_reach or min(*arm_reach, *base_reach) <= 0:
        return {"steps_ratio": None, "step_time_ratio": None}
    (arm_steps, arm_seconds), (base_steps, base_seconds) = arm_reach, base_reach
    return {"steps_ratio": arm_steps / base_steps,
            "step_time_ratio": (arm_seconds / arm_steps) / (base_seconds / base_steps)}


def _mean_step_seconds(per_step: StepTime | None, steps: int) -> float | None:
    return None if per_step is None or steps <= 0 else elapsed(per_step, steps) / steps


def ratios_by_share(
    results: Sequence[Mapping[str, Any]],
    step_seconds: Mapping[tuple[str, str], StepTime] | None,
    shares: Sequence[float],
) -> list[Row]:
    """Per task x arm, the time-to-quality ratio to full backprop at each target share (``None``: the arm
    never reaches it); a curve that wins at a low target and loses at a high one shows both.

    Example::

        >>> full = {"name": "f", "labels": {"task": "t", "arm": "full"}, "baseline": None, "curves": {},
        ...         "eval_at_steps": {"0": {"val/loss": 4.0}, "10": {"val/loss": 3.0}, "20": {"val/loss": 2.0}}}
        >>> fast = {**full, "name": "s", "labels": {"task": "t", "arm": "fast"}, "baseline": "f",
        ...         "eval_at_steps": {"0": {"val/loss": 4.0}, "10": {"val/loss": 3.0}, "20": {"val/loss": 2.5}}}
        >>> [r["ratios"] for r in ratios_by_share([full, fast], {("t", "full"): 2.0, ("t", "fast"): 1.0}, [0.5, 0.9])]
        [{0.5: 1.0, 0.9: 1.0}, {0.5: 0.5, 0.9: None}]
    """
    rows: dict[tuple[str, str], Row] = {}
    for share in shares:
        for r in time_to_quality_rows(results, step_seconds, share):
            row = rows.setdefault((r["task"], r["arm"]), {"task": r["task"], "arm": r["arm"], "ratios": {}})
            row["ratios"][share] = r["ratio_to_full"]
    return list(rows.values())


def step_time_by_epoch(results: Sequence[Mapping[str, Any]], steps_per_epoch: int) -> list[Row]:
    """Per arm (equal-steps runs), the mean recorded train seconds per step of each epoch of ``steps_per_epoch``
    steps (:func:`recorded_step_time`), and the recorded total.

    Example::

        >>> run = {"labels": {"task": "t", "arm": "a", "run": "steps"},
        ...        "curves": {"train_seconds": [2.0, 4.0, 5.0, 6.0], "total_train_seconds": 6.0}}
        >>> step_time_by_epoch([run], 2)
        [{'task': 't', 'arm': 'a', 'epochs': [2.0, 1.0], 'total_seconds': 6.0}]
    """
    return [{"task": r["labels"]["task"], "arm": r["labels"]["arm"],
             "epochs": [round(m, 4) for _, m in recorded_step_time(r, steps_per_epoch).phases],
             "total_seconds": round(float(r["curves"]["total_train_seconds"]), 4)}
            for r in results if r["labels"].get("run") == "steps"]
