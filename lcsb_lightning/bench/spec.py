"""Arms of the benchmark's studies, results keyed by the settings that produced them, and the divergence rule."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
RESULT_NAME = "result.json"
#: Studies in the order they run (``quality`` and ``ablation`` read ``recipe_speed``'s speed-ups).
STUDIES = ("recipe_speed", "quality", "ablation", "memory", "stability", "cost_model")
FINETUNE_STUDIES = ("quality", "ablation")


@dataclass(frozen=True)
class Arm:
    """One run of a study.

    Attributes:
        study: One of :data:`STUDIES`.
        name: Unique within the study; also the folder name under ``<out>/<study>/``.
        overrides: Hydra overrides of the fine-tuning config (fine-tuning arms) or none.
        labels: What the arm is (task, arm, fmt, lr, seed, shape ...), for tables and plots.
        baseline: Name of the arm it is compared with (fine-tuning studies).
        wallclock_of: For an equal-wall-clock run, the name of its equal-steps arm: it trains ``steps x speed-up``
            steps (``recipe_speed``'s speed-up of its arm over the baseline).
    """

    study: str
    name: str
    overrides: tuple[str, ...] = ()
    labels: Mapping[str, Any] = field(default_factory=dict)
    baseline: str | None = None
    wallclock_of: str | None = None


def slug(*parts: Any) -> str:
    """A folder-safe name: ``slug("sst2", "cyclic n4", "lr/1") == "sst2__cyclic-n4__lr-1"``."""
    text = "__".join(str(p) for p in parts)
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", text)


def settings_hash(settings: Any) -> str:
    """A short hash of everything that determines an arm's result (its composed config, study settings)."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def without_disabled_arms(bench: Mapping[str, Any]) -> dict[str, Any]:
    """The benchmark config without the arms set to ``null`` (how a preset or the command line drops an arm).

    Example::

        >>> without_disabled_arms({"quality": {"arms": {"full": {}, "dyadic": None}}})
        {'quality': {'arms': {'full': {}}}}
    """
    out: dict[str, Any] = dict(bench)
    for study in STUDIES:
        section = out.get(study)
        if isinstance(section, Mapping) and isinstance(section.get("arms"), Mapping):
            out[study] = {**section, "arms": {name: arm for name, arm in section["arms"].items() if arm is not None}}
    return out


def packaged_options(group: str) -> list[str]:
    """Names of a config group's options shipped in the package (``conf/<group>/*.yaml``), sorted."""
    from importlib.resources import files

    from lcsb_lightning.recipes import CONFIG_MODULE

    folder = files(CONFIG_MODULE) / group
    return sorted(f.name.removesuffix(".yaml") for f in folder.iterdir() if f.name.endswith(".yaml"))


def finetune_arms(study: str, q: Mapping[str, Any]) -> list[Arm]:
    """Every task x arm of a fine-tuning study, baselines first; an arm with a baseline and ``wallclock: true`` gets
    a twin that trains for the baseline's wall-clock time.

    Raises:
        ValueError: an arm names a baseline that is not an arm, or a key of ``task_overrides`` is neither in
            ``tasks`` nor a packaged task (a preset may hold every task's overrides; those of ``tasks`` apply).
    """
    arms_cfg: Mapping[str, Any] = q["arms"]
    for name, arm in arms_cfg.items():
        base = arm.get("baseline")
        if base is not None and base not in arms_cfg:
            raise ValueError(f"{study} arm {name!r}: baseline {base!r} is not an arm ({', '.join(arms_cfg)})")
    task_overrides: Mapping[str, Sequence[str]] = q.get("task_overrides") or {}
    packaged = packaged_options("task")
    unknown = set(task_overrides) - set(q["tasks"]) - set(packaged)
    if unknown:
        raise ValueError(f"task_overrides for tasks not in {study}.tasks and not packaged task configs: "
                         f"{sorted(unknown)}; packaged: {', '.join(packaged)}")
    order = sorted(arms_cfg, key=lambda n: arms_cfg[n].get("baseline") is not None)  # stable: baselines first
    out: list[Arm] = []
    for task in q["tasks"]:
        for name in order:
            arm = arms_cfg[name]
            overrides = (f"model={q['model']}", f"task={task}", f"seed={q['seed']}", *q.get("common", ()),
                         *task_overrides.get(task, ()), *arm["overrides"])
            base = arm.get("baseline")
            labels = {"task": task, "arm": name, "run": "steps"}
            equal_steps = Arm(study, slug(task, name), tuple(overrides), labels, slug(task, base) if base else None)
            out.append(equal_steps)
            if base and arm.get("wallclock", False):
                out.append(Arm(study, slug(task, name, "wallclock"), tuple(overrides), {**labels, "run": "wallclock"},
                               equal_steps.baseline, wallclock_of=equal_steps.name))
    return out


def recipe_speed_arms(r: Mapping[str, Any]) -> list[Arm]:
    """One timing arm per task (all of the task's arms alternate inside it)."""
    return [Arm("recipe_speed", slug(task), (), {"task": task}) for task in r["tasks"]]


def stability_arms(s: Mapping[str, Any]) -> list[Arm]:
    """Expand ``benchmark.stability`` into arms: arm x format x learning rate x seed."""
    out: list[Arm] = []
    for name, arm_overrides in s["arms"].items():
        for fmt in s["formats"]:
            for lr in s["lrs"]:
                for seed in s["seeds"]:
                    overrides = (f"model={s['model']}", f"task={s['task']}", *s.get("common", ()), *arm_overrides,
                                 f"mebp={fmt}", f"module.lr={lr}", f"seed={seed}")
                    labels = {"arm": name, "fmt": fmt, "lr": float(lr), "seed": int(seed)}
                    out.append(Arm("stability", slug(name, fmt, f"lr{lr}", f"s{seed}"), overrides, labels))
    return out


def memory_arms(m: Mapping[str, Any]) -> list[Arm]:
    """Expand ``benchmark.memory``: each shape x its sequence lengths x config, then each ablation at ``ablation_at``
    (``[shape, seq_len]``), under each of ``optimizers`` (default ``[adamw]``; the others end the arm's name).

    Raises:
        ValueError: ``optimizers`` is not a non-empty list of :data:`~lcsb_lightning.bench.memory.OPTIMIZERS`,
            or names one twice.
    """
    from lcsb_lightning.bench.memory import OPTIMIZERS, check_optimizer

    optimizers = m.get("optimizers", ["adamw"])
    if isinstance(optimizers, (str, bytes)) or not isinstance(optimizers, Sequence) or not optimizers:
        raise ValueError(f"benchmark.memory.optimizers must be a non-empty list of {list(OPTIMIZERS)}, got {optimizers!r}")
    for index, name in enumerate(optimizers):
        check_optimizer(name, "benchmark.memory.optimizers")
        if name in list(optimizers)[:index]:
            raise ValueError(f"benchmark.memory.optimizers names {name!r} twice: {list(optimizers)}")
    rows = [(shape, int(seq), name) for shape, seqs in m["rows"].items() for seq in seqs for name in m["configs"]]
    if m.get("ablations"):
        shape, seq = m["ablation_at"]
        rows += [(shape, int(seq), name) for name in m["ablations"]]
    return [Arm("memory", slug(shape, seq, name, *([] if optimizer == "adamw" else [optimizer])), (),
                {"shape": shape, "seq_len": seq, "config": name, "optimizer": optimizer})
            for shape, seq, name in rows for optimizer in optimizers]


def arm_dir(root: Path, arm: Arm) -> Path:
    """``<root>/<study>/<name>``."""
    return root / arm.study / arm.name


def load_result(root: Path, arm: Arm, expected_hash: str | None = None) -> dict[str, Any] | None:
    """The arm's finished result; None when it is missing, unreadable or of another ``expected_hash``."""
    path = arm_dir(root, arm) / RESULT_NAME
    try:
        result = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if expected_hash is not None and result.get("settings_hash") != expected_hash:
        return None
    return result


def pending(root: Path, arm: Arm, settings: Any) -> str | None:
    """The hash of ``settings`` when the arm must run; None (logged) when it finished with these settings."""
    expected = settings_hash(settings)
    if load_result(root, arm, expected) is None:
        return expected
    log.info("%s %s: done with these settings, skipped", arm.study, arm.name)
    return None


def finished(root: Path, arms: Sequence[Arm]) -> list[dict[str, Any]]:
    """The results of the arms that have finished (whatever their settings), in the arms' order."""
    return [r for a in arms if (r := load_result(root, a)) is not None]


def diverged(train_losses: Sequence[float], initial_eval: float | None, final_eval: float | None) -> tuple[bool, str]:
    """The stability study's rule: a run diverges when a training loss or the final eval loss is not finite, or the
    final eval loss is above its value before training.

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
