"""One fine-tuning arm of the quality, ablation or stability study: ``run_finetune`` plus the recorder, in this
process or in a fresh one (``python -m lcsb_lightning.bench.finetune_arm <arm.json>``: its whole-process peak is
the arm's own)."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from lcsb_lightning.bench.recorder import CurveRecorder
from lcsb_lightning.bench.spec import RESULT_NAME, Arm, diverged, settings_hash
from lcsb_lightning.policies import FullPolicy
from lcsb_lightning.atomic_files import atomic_write_json

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


def arm_settings(cfg: DictConfig, eval_steps: Sequence[int], fresh_process: bool = False) -> dict[str, Any]:
    """Everything that determines the arm's result: the resolved config, the evaluation steps and whether the arm
    runs in a process of its own."""
    settings = {"config": OmegaConf.to_container(cfg, resolve=True), "eval_steps": list(eval_steps)}
    return {**settings, "fresh_process": True} if fresh_process else settings


def run_finetune_arm_in_fresh_process(arm: Arm, out_dir: Path, cfg: DictConfig, steps: int,
                                      eval_steps: Sequence[int] = ()) -> dict[str, Any]:
    """:func:`run_finetune_arm` in a new Python process, so that the result's ``peak_rss_mb`` is the arm's own
    whole-process peak (in one process, every arm after the first would report the largest so far).

    Raises:
        subprocess.CalledProcessError: the arm's process failed (its output went to this process's).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "arm.json"
    atomic_write_json(spec, {"arm": dataclasses.asdict(arm), "config": OmegaConf.to_container(cfg, resolve=True),
                             "steps": steps, "eval_steps": list(eval_steps)})
    subprocess.run([sys.executable, "-m", "lcsb_lightning.bench.finetune_arm", str(spec)], check=True)
    return json.loads((out_dir / RESULT_NAME).read_text())


def run_finetune_arm(arm: Arm, out_dir: Path, cfg: DictConfig, steps: int, eval_steps: Sequence[int] = (),
                     fresh_process: bool = False) -> dict[str, Any]:
    """Fine-tune one arm and write ``<out_dir>/result.json`` (last, atomically: it marks the arm done).

    Args:
        arm: The arm.
        out_dir: The arm's folder (``run_finetune``'s output directory).
        cfg: The arm's config (:func:`arm_config`).
        steps: Optimizer steps of the run.
        eval_steps: Steps (< ``steps``) after which to evaluate mid-fit; ``steps`` itself is the final evaluation.
        fresh_process: This process runs only this arm (:func:`run_finetune_arm_in_fresh_process`).

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
        "study": arm.study, "name": arm.name, "labels": dict(arm.labels), "overrides": list(arm.overrides),
        "baseline": arm.baseline, "wallclock_of": arm.wallclock_of, "steps": steps, "eval_at_steps": at_steps,
        "diverged": bad, "divergence_reason": reason, "curves": curves,
        "summary": {k: summary.get(k) for k in SUMMARY_KEYS}, "fresh_process": fresh_process,
        "settings_hash": settings_hash(arm_settings(cfg, eval_steps, fresh_process)),
    }
    atomic_write_json(out_dir / RESULT_NAME, result)
    log.info("arm %s/%s done: eval loss %s -> %s in %d steps", arm.study, arm.name, initial, final, summary["steps"])
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """Run the arm that ``arm.json`` (written by :func:`run_finetune_arm_in_fresh_process`) describes."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec_path = Path((sys.argv[1:] if argv is None else argv)[0])
    spec = json.loads(spec_path.read_text())
    fields = spec["arm"]
    arm = Arm(**{**fields, "overrides": tuple(fields["overrides"])})
    run_finetune_arm(arm, spec_path.parent, OmegaConf.create(spec["config"]), int(spec["steps"]), spec["eval_steps"],
                     fresh_process=True)


if __name__ == "__main__":
    main()
