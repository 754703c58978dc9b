"""``CurveRecorder``: per-step loss, train time and selection, evaluations at fixed steps, LCSB's probes."""

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
    """Records every optimizer step's training loss, cumulative train time and selection, and evaluates
    after the optimizer steps in ``eval_steps`` (their time is not train time). A non-finite loss
    stops the fit: nothing more is learned from a diverged run.

    Args:
        eval_steps: Optimizer steps after which to evaluate.
    """

    def __init__(self, eval_steps: Sequence[int] = ()) -> None:
        super().__init__()
        self.eval_steps = sorted({int(s) for s in eval_steps})
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.selections: list[list[int]] = []
        self.evals: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        lcsb = _lcsb(trainer)
        self.probes = [{"step": r.step, "cosine": r.cosine, "norm_ratio": r.norm_ratio}
                       for r in (lcsb.probe_results if lcsb is not None else [])]

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
        self.seconds.append(round(self.total_seconds, 4))
        lcsb = _lcsb(trainer)
        self.selections.append(list(lcsb.selection) if lcsb is not None else [])
        if step in self.eval_steps:  # mid-run: losses and accuracy only, the generations of exact match at the end
            generate, pl_module.generate = getattr(pl_module, "generate", False), False
            try:
                metrics = evaluate(pl_module, trainer.val_dataloaders)
            finally:
                pl_module.generate = generate
            self.evals.append({"step": step, "train_seconds": round(self.total_seconds, 4), "metrics": metrics})
        if not math.isfinite(self.losses[-1]):
            trainer.should_stop = True

    def result(self) -> dict[str, Any]:
        """Everything recorded, JSON-serialisable (with LCSB's probe results when it probed)."""
        return {"steps": self.steps, "train_loss": self.losses, "train_seconds": self.seconds,
                "selections": self.selections, "evals": self.evals, "probes": self.probes,
                "total_train_seconds": round(self.total_seconds, 4)}


def _lcsb(trainer: Trainer) -> Any:
    from lcsb_lightning.callback import LCSBCallback

    return next((cb for cb in trainer.callbacks if isinstance(cb, LCSBCallback)), None)
