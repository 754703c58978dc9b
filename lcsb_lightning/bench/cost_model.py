"""The step-cost model across scales: a step costs ``a + b·d`` of full backprop's, ``d`` the backward's depth.

For every random-init shape and ``mebp`` pipeline, fixed-depth arms alternate in the recipe's loop; least squares on
``t(d) / t_full`` gives ``a`` and ``b``, and the same fit per phase splits ``a`` (:data:`SPLIT`).
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lcsb_lightning.bench.spec import RESULT_NAME, Arm, arm_dir, finished, packaged_options, pending, slug
from lcsb_lightning.atomic_files import atomic_write_json
from lcsb_lightning.validation import check_int

log = logging.getLogger(__name__)
#: The constant's parts: ``forward`` is the blocks' forward with their decompression (the recipe's forward
#: less the LM head and loss), ``backward`` the backward's constant (the head's and the loss's backward),
#: ``rest`` zero_grad, LCSB's gradient bookkeeping, clipping and the time between steps.
SPLIT = ("forward", "lm_head_and_loss", "backward", "optimizer", "rest")
_REST = ("zero_grad", "before_step", "clip", "between")


def depth_arms(depths: Sequence[float]) -> dict[str, list[str]]:
    """The fixed-depth arms: ``{"d0.125": [policy=top_only, ...], ..., "full": [policy=full]}`` (full always).

    Raises:
        ValueError: a depth outside (0, 1].
    """
    bad = [d for d in depths if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1]
    if bad or not depths:
        raise ValueError(f"`depths` must be a non-empty list of shares of the blocks in (0, 1], got {list(depths)!r}.")
    arms = {f"d{float(d):g}": ["policy=top_only", f"policy.fraction={float(d)}", "lcsb.backward=all_reached"]
            for d in sorted(set(map(float, depths))) if d < 1}
    return {**arms, "full": ["policy=full"]}


def realized_depth(overrides: Sequence[str], num_blocks: int) -> float:
    """The share of ``num_blocks`` the arm's backward reaches (``top_only`` trains ``max(1, round(f N))`` blocks)."""
    from lcsb_lightning.policies import TopOnlyPolicy

    fraction = next((o.split("=", 1)[1] for o in overrides if o.startswith("policy.fraction=")), None)
    if fraction is None:
        return 1.0
    policy = TopOnlyPolicy(fraction=float(fraction))
    policy.setup(num_blocks=num_blocks)
    return len(policy.select(0)) / num_blocks


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b)``.

    Example::

        >>> fit_line([0.25, 0.5, 1.0], [0.55, 0.7, 1.0])
        (0.4, 0.6)

    Raises:
        ValueError: fewer than two distinct ``xs``, or ``xs`` and ``ys`` of different lengths.
    """
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"A line needs points at two or more distinct depths, got xs={list(xs)!r}, ys={list(ys)!r}.")
    b, a = statistics.linear_regression(xs, ys)
    return round(a, 12), round(b, 12)


def split_phases(step: Mapping[str, float]) -> dict[str, float]:
    """One step's :class:`~lcsb_lightning.bench.recipe_speed.PhaseTimer` row as the parts of :data:`SPLIT`."""
    head = step.get("lm_head_and_loss", 0.0)
    return {"forward": step["forward"] - head, "lm_head_and_loss": head, "backward": step["backward"],
            "optimizer": step["optimizer"], "rest": sum(step.get(p, 0.0) for p in _REST)}


def _round_means(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    parts = [split_phases(s) for s in steps]
    return {k: statistics.fmean(p[k] for p in parts) for k in SPLIT} | {"total": statistics.fmean(s["total"] for s in steps)}


def fit_cost(raw: Mapping[str, Sequence[Sequence[Mapping[str, float]]]], depths: Mapping[str, float]) -> dict[str, Any]:
    """``a`` and ``b`` of ``t(d) / t_full`` per round and pooled, and the split of ``a`` into :data:`SPLIT`.

    Args:
        raw: Arm -> rounds -> timed steps (``time_task``'s ``raw``); ``full`` among the arms.
        depths: Arm -> its realized depth.

    Returns:
        ``{"a", "b", "a_rounds", "b_rounds", "a_spread", "split": {part: intercept}, "slopes", "points",
        "full_s"}``: every figure a share of the round's full-backprop step, ``full_s`` its median in seconds.

    Raises:
        ValueError: no ``full`` arm, rounds of unequal number, or fewer than two distinct depths.
    """
    if "full" not in raw or set(raw) != set(depths):
        raise ValueError(f"`raw` needs the arm 'full' and exactly the arms of `depths`; got {sorted(raw)} and {sorted(depths)}.")
    rounds = {len(r) for r in raw.values()}
    if len(rounds) != 1:
        raise ValueError(f"Every arm needs the same number of rounds, got {({n: len(r) for n, r in raw.items()})}.")
    means = {name: [_round_means(steps) for steps in arm_rounds] for name, arm_rounds in raw.items()}
    per_round, points = [], []
    for i in range(rounds.pop()):
        full = means["full"][i]["total"]
        pts = [(depths[n], {k: v / full for k, v in means[n][i].items()}) for n in raw]
        points += pts
        per_round.append(fit_line([d for d, _ in pts], [p["total"] for _, p in pts]))
    pooled = {k: fit_line([d for d, _ in points], [p[k] for _, p in points]) for k in (*SPLIT, "total")}
    a_rounds = [a for a, _ in per_round]
    return {"a": pooled["total"][0], "b": pooled["total"][1], "a_rounds": a_rounds, "b_rounds": [b for _, b in per_round],
            "a_spread": max(a_rounds) - min(a_rounds), "split": {k: pooled[k][0] for k in SPLIT},
            "slopes": {k: pooled[k][1] for k in SPLIT}, "points": [[d, p["total"]] for d, p in points],
            "full_s": statistics.median(m["total"] for m in means["full"])}


def projected_ratio(a: float, b: float, steps_ratio: float, depth: float) -> float:
    """Time to quality against full backprop's, on paper: ``steps_ratio * (a + b * depth)``.

    Example::

        >>> round(projected_ratio(0.47, 0.53, 1.25, 0.5), 4)
        0.9187
    """
    return steps_ratio * (a + b * depth)


def break_even(params: Sequence[float], ratios: Sequence[float], target: float) -> float | None:
    """The smallest parameter count from which a projected ratio is at most ``target``, linear in ``log(params)``
    between the measured shapes (None where no shape reaches it).

    Example::

        >>> round(break_even([1e8, 1e9], [1.2, 0.8], 1.0) / 1e8, 3)  # halfway in log(params)
        3.162
        >>> break_even([1e8, 1e9], [1.2, 1.1], 1.0) is None
        True
    """
    order = sorted(zip(params, ratios))
    if not order:
        return None
    if order[0][1] <= target:
        return order[0][0]
    for (p0, r0), (p1, r1) in zip(order, order[1:]):
        if r1 <= target:
            share = (r0 - target) / (r0 - r1)
            return math.exp(math.log(p0) + share * (math.log(p1) - math.log(p0)))
    return None


# ------------------------------------------------------------------------------------- the study
def arms(c: Mapping[str, Any]) -> list[Arm]:
    """One timing arm per shape x pipeline (its depths alternate inside it), checked before any work.

    Raises:
        ValueError: a bad ``depths``, ``rounds`` or ``steps_per_round``, or a pipeline that is no ``mebp`` option.
    """
    depth_arms(c["depths"])
    options = packaged_options("mebp")
    bad = [p for p in c["pipelines"] if p not in options]
    if bad or not c["pipelines"]:
        raise ValueError(f"benchmark.cost_model.pipelines must name mebp options, got {list(c['pipelines'])!r}; allowed: {options}")
    check_int("benchmark.cost_model.rounds", c["rounds"], 1)
    for shape in c["shapes"]:
        steps_per_round(c, shape)
    return [Arm("cost_model", slug(shape, p), (), {"shape": shape, "pipeline": p}) for shape in c["shapes"] for p in c["pipelines"]]


def steps_per_round(c: Mapping[str, Any], shape: str) -> int:
    """The shape's timed steps per arm and round: ``steps_per_round`` (an integer, or shape -> integer or ``default``).

    Raises:
        ValueError: not an integer >= 1, or a mapping with neither the shape nor ``default`` (naming the shape).
    """
    spec = c["steps_per_round"]
    steps = spec.get(shape, spec.get("default")) if isinstance(spec, Mapping) else spec
    return check_int(f"benchmark.cost_model.steps_per_round (of {shape!r}; a mapping needs the shape or `default`)", steps, 1)


def run(study_arms: Sequence[Arm], c: Mapping[str, Any], root: Path, compose: Any, bench: Mapping[str, Any]) -> None:
    """Time every pending shape x pipeline and write its fit to its ``result.json`` (the runner's study hook).

    Raises:
        ValueError: a shape that is no random-init option (before it is timed).
    """
    from hydra.utils import instantiate

    from lcsb_lightning.bench.recipe_speed import time_task

    depth_overrides = depth_arms(c["depths"])
    for arm in study_arms:
        shape, pipeline = arm.labels["shape"], arm.labels["pipeline"]
        common = [f"model={shape}", f"mebp={pipeline}", *c.get("common", ())]
        steps = steps_per_round(c, shape)
        settings = {"arms": depth_overrides, "common": common, "task": c["task"], "rounds": c["rounds"], "steps": steps}
        if (expected := pending(root, arm, settings)) is None:
            continue
        if not str(compose(common).model.get("_target_", "")).endswith(".random_init"):
            raise ValueError(f"benchmark.cost_model.shapes: {shape!r} is no random-init shape (model._target_ "
                             "lcsb_lightning.recipes.models.random_init); allowed: e.g. smollm2_135m_random, "
                             "smollm2_360m_random, qwen2.5_0.5b, qwen2.5_1.5b, qwen2.5_3b, gemma3_1b, tiny")
        meta = instantiate(compose([*common, f"task={c['task']}", "model.init_device=meta"]).model).model
        params, num_blocks = sum(p.numel() for p in meta.parameters()), int(meta.config.num_hidden_layers)
        del meta
        depths = {name: realized_depth(o, num_blocks) for name, o in depth_overrides.items()}
        log.info("cost_model %s: %d blocks, depths %s, %d rounds of %d steps", arm.name, num_blocks, depths, c["rounds"], steps)
        folder = arm_dir(root, arm)
        timing = time_task(c["task"], depth_overrides, common, compose, check_int("rounds", c["rounds"], 1), steps,
                           folder / "logs")
        atomic_write_json(folder / RESULT_NAME, {
            "study": "cost_model", "name": arm.name, "labels": dict(arm.labels), "params": params, "num_blocks": num_blocks,
            "depths": depths, "fit": fit_cost(timing["raw"], depths), "timing": timing, "settings_hash": expected})
        gc.collect()


def rows(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per shape x pipeline: parameters, ``a``, ``b``, the spread of ``a`` over rounds, the split of ``a``."""
    out, pipelines = [], list(dict.fromkeys(r["labels"]["pipeline"] for r in results))  # in the config's order
    for r in sorted(results, key=lambda r: (pipelines.index(r["labels"]["pipeline"]), r["params"])):
        fit = r["fit"]
        pipeline = r["labels"]["pipeline"]
        out.append({"shape": r["labels"]["shape"], "params": r["params"],
                    "pipeline": "float32" if pipeline == "none" else pipeline,
                    "num_blocks": r["num_blocks"], "full_s": fit["full_s"], "a": fit["a"], "b": fit["b"],
                    "a_spread": fit["a_spread"], "a_min": min(fit["a_rounds"]), "a_max": max(fit["a_rounds"]),
                    "split": fit["split"], "loadavg": [r["timing"].get("loadavg_before"), r["timing"].get("loadavg_after")]})
    return out


def projection_rows(table: Sequence[Mapping[str, Any]], projection: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per pipeline, policy and steps ratio: every shape's projected time-to-quality ratio and :func:`break_even`."""
    out = []
    targets = [float(t) for t in projection.get("targets", (1.0, 0.8))]
    for pipeline in dict.fromkeys(r["pipeline"] for r in table):
        shapes = [r for r in table if r["pipeline"] == pipeline]
        for policy, p in (projection.get("policies") or {}).items():
            for s in p["steps_ratio"]:
                ratios = [projected_ratio(r["a"], r["b"], float(s), float(p["depth"])) for r in shapes]
                out.append({"pipeline": pipeline, "policy": policy, "depth": float(p["depth"]), "steps_ratio": float(s),
                            "ratios": {r["shape"]: x for r, x in zip(shapes, ratios)},
                            "break_even": {f"{t:g}": break_even([r["params"] for r in shapes], ratios, t) for t in targets}})
    return out


def tables(root: Path, study_arms: Sequence[Arm], c: Mapping[str, Any]) -> dict[str, Any]:
    """The study's tables from its finished arms: ``cost_model`` and ``cost_model_projection``."""
    table = rows(finished(root, study_arms))
    return {"cost_model": table, "cost_model_projection": projection_rows(table, c.get("projection") or {})}
