"""``CurveRecorder``: per-step loss and train time, and evaluations at fixed steps and wall-clock budgets."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from lightning import LightningModule, Trainer

from lcsb_lightning.recipes.progress import StepTimer


def _scalar(value: Any) -> float:
    return float(value.detach().float().item()) if isinstance(value, torch.Tensor) else float(value)


def evaluate(module: LightningModule, loader: Any) -> dict[str, float]:
    """Run ``module``'s own validation steps over ``loader`` outside Lightning's loops.

    Uses the metric objects of :class:`~lcsb_lightning.recipes.module.CausalLMModule` (``val_lm``,
    and ``val_acc`` or ``val_em``) so the figures are the ones ``trainer.validate`` reports.

    Returns:
        ``{"val/loss": ..., "val/ppl": ..., "val/token_acc": ..., ["val/accuracy" | "val/exact_match"]}``.
    """
    was_training = module.training
    module.eval()
    if hasattr(module, "on_validation_epoch_start"):
        module.on_validation_epoch_start()
    try:
        with torch.no_grad():
            for index, batch in enumerate(loader):
                module.validation_step(batch, index)
        out = {f"val/{k}": _scalar(v) for k, v in module.val_lm.compute().items()}
        module.val_lm.reset()
        kind = getattr(module, "kind", None)
        if kind == "classification":
            out["val/accuracy"] = _scalar(module.val_acc.compute())
            module.val_acc.reset()
        elif kind == "qa" and int(module.val_em.total) > 0:
            out["val/exact_match"] = _scalar(module.val_em.compute())
            module.val_em.reset()
    finally:
        module.train(was_training)
    return out


class CurveRecorder(StepTimer):
    """Records every optimizer step's training loss and cumulative train time, and evaluates mid-fit.

    Train time is the sum of the batches' wall time (forward, backward, optimizer step), so the
    recorder's own evaluations do not count. Evaluations happen after the optimizer steps listed in
    ``eval_steps`` and once when the train time first reaches ``budget_seconds``. With
    ``min_steps``/``budget_seconds`` the fit stops as soon as both are reached (the Trainer's
    ``max_steps`` stays the hard cap).

    Args:
        eval_steps: Optimizer steps after which to evaluate.
        budget_seconds: A wall-clock budget of train time (None: none).
        min_steps: Steps to run at least before stopping early for the budget (None: never stop early).
    """

    def __init__(
        self, eval_steps: Sequence[int] = (), budget_seconds: float | None = None, min_steps: int | None = None
    ) -> None:
        if budget_seconds is not None and not budget_seconds > 0:
            raise ValueError(f"budget_seconds must be positive, got {budget_seconds}")
        super().__init__()
        self.eval_steps = sorted({int(s) for s in eval_steps})
        self.budget_seconds = budget_seconds
        self.min_steps = min_steps
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.selections: list[list[int]] = []
        self.evals: list[dict[str, Any]] = []
        self.budget_eval: dict[str, Any] | None = None

    @property
    def train_seconds(self) -> float:
        """Summed wall time of the training batches so far (evaluations excluded)."""
        return self.total_seconds

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is None:
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = int(trainer.global_step)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.steps.append(step)
        self.losses.append(_scalar(loss) if loss is not None else math.nan)
        self.seconds.append(round(self.train_seconds, 4))
        selection = next((cb.selection for cb in trainer.callbacks if isinstance(getattr(cb, "selection", None), tuple)), ())
        self.selections.append(list(selection))
        budget_hit = self.budget_seconds is not None and self.budget_eval is None and self.train_seconds >= self.budget_seconds
        if step in self.eval_steps or budget_hit:
            metrics = evaluate(pl_module, trainer.val_dataloaders)
            record = {"step": step, "train_seconds": round(self.train_seconds, 4), "metrics": metrics}
            if step in self.eval_steps:
                self.evals.append(record)
            if budget_hit:
                self.budget_eval = record
        if not math.isfinite(self.losses[-1]):
            trainer.should_stop = True  # diverged: nothing more to learn from this run
        if self.min_steps is not None and step >= self.min_steps:
            if self.budget_seconds is None or self.budget_eval is not None:
                trainer.should_stop = True

    def result(self) -> dict[str, Any]:
        """Everything recorded, JSON-serialisable."""
        return {
            "steps": self.steps,
            "train_loss": self.losses,
            "train_seconds": self.seconds,
            "selections": self.selections,
            "evals": self.evals,
            "budget_seconds": self.budget_seconds,
            "budget_eval": self.budget_eval,
            "total_train_seconds": round(self.train_seconds, 4),
        }
