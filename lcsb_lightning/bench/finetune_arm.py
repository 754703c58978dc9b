"""One quality or stability arm: ``run_finetune`` on a composed config, plus the benchmark's recorder."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lcsb_lightning.bench.recorder import CurveRecorder
from lcsb_lightning.bench.spec import RESULT_NAME, Arm, diverged
from lcsb_lightning.recipes.outputs import atomic_write_json

log = logging.getLogger(__name__)

Compose = Callable[[Sequence[str]], DictConfig]

#: Fields of ``summary.json`` kept in an arm's result.
SUMMARY_KEYS = (
    "model", "task", "task_kind", "policy", "initial_metrics", "final_metrics", "steps", "train_step_seconds",
    "steps_per_second", "peak_rss_mb", "num_blocks", "block_selection_counts", "lora_parameters",
    "train_examples", "eval_examples",
)


def stop_overrides(cap: int) -> list[str]:
    """Trainer overrides of a benchmark arm: at most ``cap`` steps, no periodic validation of Lightning's
    (the recorder evaluates itself), no progress bar."""
    return [f"trainer.max_steps={cap}", f"trainer.val_check_interval={cap + 1}", "trainer.enable_progress_bar=false"]


def run_finetune_arm(
    arm: Arm,
    out_dir: Path,
    compose: Compose,
    steps: int,
    eval_steps: Sequence[int] = (),
    budget_seconds: float | None = None,
    max_steps: int | None = None,
) -> dict[str, Any]:
    """Fine-tune one arm and write ``<out_dir>/result.json`` (last, atomically: its presence marks the arm done).

    Args:
        arm: The arm (its overrides compose ``conf/config.yaml``).
        out_dir: The arm's folder (``run_finetune``'s output directory).
        compose: Composes the fine-tuning config from overrides.
        steps: Optimizer steps of the equal-steps comparison.
        eval_steps: Steps (< ``steps``) after which to evaluate mid-fit; ``steps`` itself is the final evaluation.
        budget_seconds: Train-time budget of the equal-wall-clock comparison; the arm keeps training
            past ``steps`` until it is spent (at most ``max_steps``) and evaluates there.
        max_steps: Cap on the steps spent reaching the budget (default ``4 * steps``).

    Returns:
        The result written.
    """
    from lcsb_lightning.recipes.train import run_finetune

    cap = steps if budget_seconds is None else max(steps, max_steps or 4 * steps)
    cfg = compose([*arm.overrides, *stop_overrides(cap), "eval_before_training=true"])
    recorder = CurveRecorder(
        eval_steps=[s for s in eval_steps if 0 < s < steps] + ([steps] if budget_seconds is not None else []),
        budget_seconds=budget_seconds,
        min_steps=steps,
    )
    summary = run_finetune(cfg, out_dir, extra_callbacks=[recorder])
    curves = recorder.result()
    finite = all(math.isfinite(x) for x in curves["train_loss"])
    if len(curves["steps"]) < steps and finite:  # interrupted (SIGTERM, max_time...): not a finished arm
        raise RuntimeError(f"arm {arm.name} stopped after {len(curves['steps'])} of {steps} steps; rerun to resume")
    at_steps = {str(e["step"]): e["metrics"] for e in curves["evals"]}
    at_steps["0"] = summary["initial_metrics"]
    if budget_seconds is None:  # the run stopped at `steps` (or earlier, diverged): its final eval
        at_steps[str(summary["steps"])] = summary["final_metrics"]
    initial = summary["initial_metrics"].get("val/loss")
    final = at_steps.get(str(steps), summary["final_metrics"]).get("val/loss")
    bad, reason = diverged(curves["train_loss"][:steps], initial, final)
    result: dict[str, Any] = {
        "study": arm.study,
        "name": arm.name,
        "labels": dict(arm.labels),
        "overrides": list(arm.overrides),
        "baseline": arm.baseline,
        "wallclock": budget_seconds is not None or arm.baseline is None,
        "equal_steps": steps,
        "eval_at_steps": at_steps,
        "eval_at_budget": curves["budget_eval"] or (
            {"step": summary["steps"], "train_seconds": curves["total_train_seconds"], "metrics": summary["final_metrics"]}
            if budget_seconds is None else None
        ),
        "train_seconds_at_steps": curves["train_seconds"][steps - 1] if len(curves["train_seconds"]) >= steps else None,
        "diverged": bad,
        "divergence_reason": reason,
        "curves": curves,
        "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
    }
    atomic_write_json(out_dir / RESULT_NAME, result)
    log.info("arm %s/%s done: eval loss %s -> %s", arm.study, arm.name, initial, final)
    return result
