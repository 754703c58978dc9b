"""``DivergenceGuard``: catch a non-finite loss or gradient, or a loss spike, before the optimizer applies it."""

from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

ACTIONS = ("skip", "rollback", "stop")


class DivergenceGuard(Callback):
    """Checks every optimizer step, before the update, for a non-finite loss, a non-finite gradient, or a
    loss above ``spike_factor`` times the median of the last ``window`` losses, and then acts:

    ``"skip"``
        the step makes no update: every gradient is cleared (AdamW leaves a parameter without a
        gradient untouched, its moments and weight decay included).
    ``"rollback"``
        the trainable parameters and the optimizer state go back to the last good snapshot (taken
        after every ``snapshot_every`` good updates, in memory: LoRA-sized), every learning rate is multiplied
        by ``lr_factor`` (the scheduler's base rates too), and the step makes no update.
    ``"stop"``
        the step makes no update and the fit stops with a message naming the step and the reason.

    Every event goes to the loggers (``guard/events``) and to :attr:`events`. List the guard after
    ``LCSBCallback`` so that it sees the gradients LCSB leaves.

    Args:
        action: ``"skip"``, ``"rollback"`` or ``"stop"``.
        spike_factor: A loss above this multiple of the running median is a spike (``> 1``).
        window: Losses in the running median.
        warmup: Steps before spikes are looked for (non-finite values are caught from the first step).
        lr_factor: Learning-rate multiplier of a rollback, in (0, 1].
        snapshot_every: Good steps between in-memory snapshots (rollback only).

    Example::

        from lightning.pytorch import Trainer
        from lcsb_lightning import DivergenceGuard, LCSBCallback

        trainer = Trainer(callbacks=[LCSBCallback(), DivergenceGuard(action="rollback")])
    """

    def __init__(
        self,
        action: str = "skip",
        spike_factor: float = 4.0,
        window: int = 50,
        warmup: int = 20,
        lr_factor: float = 0.5,
        snapshot_every: int = 25,
    ) -> None:
        if action not in ACTIONS:
            raise ValueError(f"`action={action!r}` is not supported; allowed: {', '.join(ACTIONS)}.")
        if not spike_factor > 1:
            raise ValueError(f"`spike_factor` must be > 1, got {spike_factor!r}.")
        if not 0 < lr_factor <= 1:
            raise ValueError(f"`lr_factor` must be in (0, 1], got {lr_factor!r}.")
        for name, value in (("window", window), ("snapshot_every", snapshot_every)):
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
        if isinstance(warmup, bool) or int(warmup) != warmup or warmup < 0:
            raise ValueError(f"`warmup` must be an integer >= 0, got {warmup!r}.")
        self.action, self.spike_factor, self.lr_factor = action, float(spike_factor), float(lr_factor)
        self.window, self.warmup, self.snapshot_every = int(window), int(warmup), int(snapshot_every)
        self.events: list[dict[str, Any]] = []
        self._losses: deque[float] = deque(maxlen=self.window)
        self._loss: float | None = None
        self._good_steps = 0
        self._good = False
        self._snapshot: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------- hooks
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        value = float(loss.detach())
        # Accumulation: the worst micro-batch decides.
        self._loss = value if self._loss is None or not math.isfinite(value) else max(self._loss, value)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        loss, self._loss = self._loss, None
        reason = self._problem(loss, optimizer)
        self._good = reason is None
        if reason is None:
            if loss is not None:
                self._losses.append(loss)
            self._good_steps += 1
            return
        step = trainer.global_step
        # A non-finite loss is kept as text: summary.json stays standard JSON.
        event = {"step": step, "reason": reason, "action": self.action,
                 "loss": loss if loss is None or math.isfinite(loss) else str(loss)}
        self.events.append(event)
        _clear_gradients(optimizer)
        if self.action == "rollback":
            event["restored"] = self._restore(trainer, optimizer)
        elif self.action == "stop":
            trainer.should_stop = True
        rank_zero_warn(f"DivergenceGuard: step {step}: {reason}; {self._describe(event)}.")
        pl_module.log("guard/events", float(len(self.events)), on_step=True, on_epoch=False)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # After a good update: the state a later rollback returns to (every `snapshot_every` good steps).
        if self.action == "rollback" and self._good and (self._snapshot is None or self._good_steps % self.snapshot_every == 0):
            self._snapshot = self._take_snapshot(trainer.optimizers[0], trainer.global_step)
        self._good = False

    # --------------------------------------------------------------------------------- checks
    def _problem(self, loss: float | None, optimizer: Optimizer) -> str | None:
        if loss is not None and not math.isfinite(loss):
            return f"non-finite loss {loss}"
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads and not all(math.isfinite(n) for n in torch.stack(torch._foreach_norm(grads)).tolist()):
            return "non-finite gradient"
        if loss is not None and self._good_steps >= self.warmup and self._losses:
            median = statistics.median(self._losses)
            if median > 0 and loss > self.spike_factor * median:
                return f"loss spike {loss:.4g} > {self.spike_factor:g} x running median {median:.4g}"
        return None

    def _describe(self, event: dict[str, Any]) -> str:
        if self.action == "skip":
            return "the update was skipped"
        if self.action == "stop":
            return "the update was skipped and training stops"
        restored = event.get("restored")
        return (f"rolled back to the state after step {restored} and multiplied the learning rates by {self.lr_factor:g}"
                if restored is not None else "no snapshot yet: the update was skipped")

    # ------------------------------------------------------------------------------- rollback
    @staticmethod
    def _take_snapshot(optimizer: Optimizer, step: int) -> dict[str, Any]:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {"params": [p.detach().clone() for p in params], "optimizer": copy.deepcopy(optimizer.state_dict()),
                "step": step}

    def _restore(self, trainer: Trainer, optimizer: Optimizer) -> int | None:
        if self._snapshot is None:
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for p, saved in zip(params, self._snapshot["params"]):
                p.copy_(saved)
        lrs = [group["lr"] for group in optimizer.param_groups]
        optimizer.load_state_dict(copy.deepcopy(self._snapshot["optimizer"]))
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr * self.lr_factor
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if getattr(scheduler, "optimizer", None) is optimizer and hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * self.lr_factor for lr in scheduler.base_lrs]
        return int(self._snapshot["step"])

    # ---------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"events": list(self.events), "losses": list(self._losses), "good_steps": self._good_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict["events"])
        self._losses = deque(state_dict["losses"], maxlen=self.window)
        self._good_steps = int(state_dict["good_steps"])


def _clear_gradients(optimizer: Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
