"""Arms of the benchmark's studies, the resume rule and the divergence rule (pure functions)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULT_NAME = "result.json"
STUDIES = ("quality", "speed", "stability")


@dataclass(frozen=True)
class Arm:
    """One run of a study.

    Attributes:
        study: ``quality``, ``speed`` or ``stability``.
        name: Unique within the study; also the folder name under ``<out>/<study>/``.
        overrides: Hydra overrides of ``conf/config.yaml`` (fine-tuning arms) or arm settings (speed).
        labels: What the arm is (task, arm, fmt, lr, seed, shape ...), for tables and plots.
        baseline: Name of the arm it is compared with (quality only): equal steps, and unless
            ``wallclock`` is false, equal wall-clock (the baseline's train time is this arm's budget).
        wallclock: Keep training past the equal steps until the baseline's train time is spent.
    """

    study: str
    name: str
    overrides: tuple[str, ...] = ()
    labels: Mapping[str, Any] = field(default_factory=dict)
    baseline: str | None = None
    wallclock: bool = True


def slug(*parts: Any) -> str:
    """A folder-safe name: ``slug("sst2", "cyclic_n4", 1e-4) == "sst2__cyclic_n4__0.0001"``."""
    text = "__".join(str(p) for p in parts)
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", text)


def quality_arms(q: Mapping[str, Any]) -> list[Arm]:
    """Expand ``benchmark.quality`` into arms: every task x every arm, baselines first in each task.

    Raises:
        ValueError: an arm names a baseline that is not an arm, or an unknown key in ``task_overrides``.
    """
    arms_cfg: Mapping[str, Any] = q["arms"]
    for name, arm in arms_cfg.items():
        base = arm.get("baseline")
        if base is not None and base not in arms_cfg:
            raise ValueError(f"quality arm {name!r}: baseline {base!r} is not an arm ({', '.join(arms_cfg)})")
    task_overrides: Mapping[str, Sequence[str]] = q.get("task_overrides") or {}
    unknown = set(task_overrides) - set(q["tasks"])
    if unknown:
        raise ValueError(f"task_overrides for tasks not in quality.tasks: {sorted(unknown)}")
    order = sorted(arms_cfg, key=lambda n: arms_cfg[n].get("baseline") is not None)  # stable: baselines first
    out: list[Arm] = []
    for task in q["tasks"]:
        for name in order:
            arm = arms_cfg[name]
            overrides = (
                f"model={q['model']}", f"task={task}", f"seed={q['seed']}", *q.get("common", ()),
                *task_overrides.get(task, ()), *arm["overrides"],
            )
            base = arm.get("baseline")
            out.append(Arm("quality", slug(task, name), tuple(overrides), {"task": task, "arm": name},
                           slug(task, base) if base else None, bool(arm.get("wallclock", True))))
    return out


def stability_arms(s: Mapping[str, Any]) -> list[Arm]:
    """Expand ``benchmark.stability`` into arms: arm x format x learning rate x seed."""
    out: list[Arm] = []
    for name, arm_overrides in s["arms"].items():
        for fmt in s["formats"]:
            for lr in s["lrs"]:
                for seed in s["seeds"]:
                    overrides = (
                        f"model={s['model']}", f"task={s['task']}", *s.get("common", ()), *arm_overrides,
                        f"mebp={fmt}", f"module.lr={lr}", f"seed={seed}",
                    )
                    labels = {"arm": name, "fmt": fmt, "lr": float(lr), "seed": int(seed)}
                    out.append(Arm("stability", slug(name, fmt, f"lr{lr}", f"s{seed}"), overrides, labels))
    return out


def speed_arms(s: Mapping[str, Any]) -> list[Arm]:
    """Expand ``benchmark.speed`` into one memory arm per shape x arm (timing runs per shape)."""
    out: list[Arm] = []
    for shape in s["shapes"]:
        for name, fraction in s["arms"].items():
            labels = {"shape": shape, "arm": name, "fraction": float(fraction)}
            out.append(Arm("speed", slug(shape, name), (), labels))
    return out


def arm_dir(root: Path, arm: Arm) -> Path:
    """``<root>/<study>/<name>``."""
    return root / arm.study / arm.name


def load_result(root: Path, arm: Arm) -> dict[str, Any] | None:
    """The arm's finished result, or None when it has not finished (no or unreadable ``result.json``)."""
    path = arm_dir(root, arm) / RESULT_NAME
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def pending(root: Path, arms: Iterable[Arm]) -> list[Arm]:
    """Arms still to run: those without a readable ``result.json`` (a resumed benchmark skips the rest)."""
    return [arm for arm in arms if load_result(root, arm) is None]


def diverged(train_losses: Sequence[float], initial_eval: float | None, final_eval: float | None) -> tuple[bool, str]:
    """The issue's divergence rule.

    A run diverges when any training loss or the final eval loss is not finite, or when the final
    eval loss is above its value before training.

    Returns:
        ``(diverged, reason)``; the reason is ``""`` for a run that did not diverge.

    Example::

        >>> diverged([2.0, 1.5], 3.0, 2.9)
        (False, '')
        >>> diverged([2.0, float("nan")], 3.0, None)
        (True, 'non-finite training loss at step 2')
        >>> diverged([2.0], 3.0, 3.1)
        (True, 'final eval loss 3.1 above its initial 3')
    """
    for index, loss in enumerate(train_losses):
        if loss is None or not math.isfinite(loss):
            return True, f"non-finite training loss at step {index + 1}"
    if final_eval is None or not math.isfinite(final_eval):
        return True, "non-finite final eval loss"
    if initial_eval is not None and final_eval > initial_eval:
        return True, f"final eval loss {final_eval:.4g} above its initial {initial_eval:.4g}"
    return False, ""
