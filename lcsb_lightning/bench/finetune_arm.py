"""One fine-tuning arm of the quality, ablation or stability study: ``run_finetune`` plus the recorder."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from lcsb_lightning.bench.recorder import CurveRecorder
from lcsb_lightning.bench.spec import RESULT_NAME, Arm, diverged, settings_hash
from lcsb_lightning.policies import FullPolicy
from lcsb_lightning.recipes.outputs import atomic_write_json

log = logging.getLogger(__name__)

Compose = Callable[[Sequence[str]], DictConfig]

#: Fields of ``summary.json`` kept in an arm's result.
SUMMARY_KEYS = (
    "model", "task", "task_kind", "policy", "initial_metrics", "final_metrics", "steps", "train_step_seconds",
    "steps_per_second", "peak_rss_mb", "num_blocks", "block_selection_counts", "lora_parameters",
    "train_examples", "eval_examples",
)


def arm_config(arm: Arm, compose: Compose, steps: int, probe_every: int = 0) -> DictConfig:
    """The arm's fine-tuning config: its overrides, ``steps`` optimizer steps, no validation of
    Lightning's own (the recorder evaluates), no progress bar, no checkpoints (the benchmark resumes arm
    by arm), and the probe on LCSB arms."""
    extra = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps + 1}",
             "trainer.enable_progress_bar=false", "trainer.enable_checkpointing=false", "eval_before_training=true"]
    cfg = compose([*arm.overrides, *extra])
    if probe_every and cfg.get("policy") and "_target_" in cfg.policy and get_class(cfg.policy._target_) is not FullPolicy:
        cfg.lcsb.probe_every = probe_every
    return cfg


def arm_settings(cfg: DictConfig, eval_steps: Sequence[int]) -> dict[str, Any]:
    """Everything that determines the arm's result: the resolved config and the evaluation steps."""
    return {"config": OmegaConf.to_container(cfg, resolve=True), "eval_steps": list(eval_steps)}


def run_finetune_arm(arm: Arm, out_dir: Path, cfg: DictConfig, steps: int, eval_steps: Sequence[int] = ()) -> dict[str, Any]:
    """Fine-tune one arm and write ``<out_dir>/result.json`` (last, atomically: it marks the arm done).

    Args:
        arm: The arm.
        out_dir: The arm's folder (``run_finetune``'s output directory).
        cfg: The arm's config (:func:`arm_config`).
        steps: Optimizer steps of the run.
        eval_steps: Steps (< ``steps``) after which to evaluate mid-fit; ``steps`` itself is the final evaluation.

    Returns:
        The result written.
    """
    from lcsb_lightning.recipes.train import run_finetune

    mid = [s for s in eval_steps if 0 < s < steps]
    recorder = CurveRecorder(eval_steps=mid)
    summary = run_finetune(cfg, out_dir, extra_callbacks=[recorder])
    curves = recorder.result()
    at_steps = {str(e["step"]): e["metrics"] for e in curves["evals"]}
    at_steps["0"] = summary["initial_metrics"]
    at_steps[str(summary["steps"])] = summary["final_metrics"]
    initial = summary["initial_metrics"].get("val/loss")
    final = summary["final_metrics"].get("val/loss")
    bad, reason = diverged(curves["train_loss"], initial, final)
    result: dict[str, Any] = {
        "study": arm.study,
        "name": arm.name,
        "labels": dict(arm.labels),
        "overrides": list(arm.overrides),
        "baseline": arm.baseline,
        "wallclock_of": arm.wallclock_of,
        "steps": steps,
        "eval_at_steps": at_steps,
        "diverged": bad,
        "divergence_reason": reason,
        "curves": curves,
        "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
        "settings_hash": settings_hash(arm_settings(cfg, eval_steps)),
    }
    atomic_write_json(out_dir / RESULT_NAME, result)
    log.info("arm %s/%s done: eval loss %s -> %s in %d steps", arm.study, arm.name, initial, final, summary["steps"])
    return result
