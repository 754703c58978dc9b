"""``DivergenceGuard``: catch a non-finite loss or gradient, or a loss spike, before the optimizer applies it."""

from __future__ import annotations

import copy
import math
import types
import statistics
from collections import deque
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lcsb_lightning.fit_scoped import FitScopedCallback
from lcsb_lightning.validation import check_int

ACTIONS = ("skip", "rollback", "stop")


class DivergenceGuard(FitScopedCallback):
    """Checks every optimizer step, before the update, for a non-finite loss or gradient, or a loss that has stayed
    above ``spike_factor`` times the median of the last ``window`` losses for ``patience`` consecutive steps, and then:

    - ``"skip"``: the step makes no update (neither the parameters nor the optimizer state change);
    - ``"rollback"``: the trainable parameters and the optimizer state go back to the last good in-memory snapshot
      (taken every ``snapshot_every`` good steps, before their update), every learning rate (and the scheduler's base
      rates) is multiplied by ``lr_factor``, and the step makes no update;
    - ``"stop"``: the step makes no update and the fit stops, with a message naming the step and the reason.

    A non-finite value is acted on at once, a spike only when it lasts: a heavy-tailed loss (a one-token
    classification loss) has single batches far above the median, so shorter spikes are trained on. The guard wraps
    each optimizer's ``step`` for the fit, so the step runs only if the guard let it through, whatever the callbacks'
    order. Under several processes every rank decides the same. Events go to the loggers and :attr:`events`.

    Args:
        action: ``"skip"``, ``"rollback"`` or ``"stop"``.
        spike_factor: A loss above this multiple of the running median is a spike (``> 1``).
        window: Losses in the running median.
        warmup: Good steps before spikes are looked for (non-finite values are caught from the first step).
        lr_factor: Learning-rate multiplier of a rollback, in (0, 1].
        snapshot_every: Good steps between in-memory snapshots (rollback only).
        patience: Consecutive spikes that make a divergence (``>= 1``).

    Example::

        from lightning.pytorch import Trainer
        from lcsb_lightning import DivergenceGuard, LCSBCallback

        trainer = Trainer(callbacks=[LCSBCallback(), DivergenceGuard(action="rollback")])
    """

    def __init__(self, action: str = "skip", spike_factor: float = 4.0, window: int = 50, warmup: int = 20,
                 lr_factor: float = 0.5, snapshot_every: int = 25, patience: int = 5) -> None:
        if action not in ACTIONS:
            raise ValueError(f"`action={action!r}` is not supported; allowed: {', '.join(ACTIONS)}.")
        if not spike_factor > 1:
            raise ValueError(f"`spike_factor` must be > 1, got {spike_factor!r}.")
        if not 0 < lr_factor <= 1:
            raise ValueError(f"`lr_factor` must be in (0, 1], got {lr_factor!r}.")
        self.action, self.spike_factor, self.lr_factor = action, float(spike_factor), float(lr_factor)
        self.window, self.warmup = check_int("window", window, 1), check_int("warmup", warmup, 0)
        self.snapshot_every, self.patience = check_int("snapshot_every", snapshot_every, 1), check_int("patience", patience, 1)
        self.events: list[dict[str, Any]] = []
        self._losses: deque[float] = deque(maxlen=self.window)
        self._loss: float | None = None
        self._good_steps = self._spikes = 0  # good steps, consecutive spikes so far
        self._snapshot: dict[str, Any] | None = None
        self._vetoed: set[int] = set()  # ids of the optimizers whose current step must not happen
        self._wrapped: dict[int, tuple[Optimizer, Any, Any]] = {}  # id -> (optimizer, own `step` or None, wrapper)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here, not in `setup`: the strategy has built the optimizers (and their schedulers) by now.
        self._release()
        for optimizer in trainer.optimizers:
            self._wrap(optimizer)

    def _wrap(self, optimizer: Optimizer) -> None:
        own = optimizer.__dict__.get("step")  # e.g. an LR scheduler's step counter, itself a wrapper
        inner = optimizer.step

        def step(opt: Optimizer, closure: Any = None, **kwargs: Any) -> Any:
            return self._guarded_step(opt, inner, closure, **kwargs)

        if hasattr(inner, "_wrapped_by_lr_sched"):  # else the scheduler warns that the step was overridden
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        # A bound method, as torch's LR schedulers expect when they wrap `step` in turn.
        wrapper = types.MethodType(step, optimizer)
        optimizer.step = wrapper  # type: ignore[method-assign]
        self._wrapped[id(optimizer)] = (optimizer, own, wrapper)

    def _release(self) -> None:
        for optimizer, own, wrapper in self._wrapped.values():
            if optimizer.__dict__.get("step") is not wrapper:
                continue  # wrapped again by someone else since: the wrapper stays, a pass-through
            if own is None:
                del optimizer.__dict__["step"]
            else:
                optimizer.step = own  # type: ignore[method-assign]
        self._wrapped = {}
        self._vetoed = set()

    def _guarded_step(self, optimizer: Optimizer, inner: Any, closure: Any, **kwargs: Any) -> Any:
        result = None
        if closure is not None:  # None: AMP's grad scaler, which ran the closure (and the guard's check) already
            with torch.enable_grad():  # as torch's optimizers call the closure
                result = closure()
        if id(optimizer) in self._vetoed:
            self._vetoed.discard(id(optimizer))
            return result
        if closure is None:
            return inner(**kwargs)
        calls = 0

        def replay() -> Any:  # the closure's first call has run; later ones (LBFGS) run it again
            nonlocal calls
            calls += 1
            return result if calls == 1 else closure()

        return inner(closure=replay, **kwargs)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        # Lightning has divided each micro-batch's loss by accumulate_grad_batches: the sum is the mean
        # loss of the update (a non-finite one stays non-finite).
        value = float(loss.detach())
        self._loss = value if self._loss is None else self._loss + value

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        self._vetoed.discard(id(optimizer))
        loss, self._loss = self._loss, None
        loss, non_finite_loss, non_finite_grad = self._agree(trainer, loss, _has_non_finite_gradient(optimizer))
        reason, clean = self._judge(loss, non_finite_loss, non_finite_grad, trainer.world_size)
        if reason is None:
            if clean:
                # Before the update: the state this step's good loss was measured on.
                if self.action == "rollback" and (self._snapshot is None or self._good_steps % self.snapshot_every == 0):
                    self._snapshot = self._take_snapshot(optimizer, trainer.global_step)
                self._good_steps += 1
            return
        step = trainer.global_step
        # A non-finite loss is kept as text: summary.json stays standard JSON.
        event = {"step": step, "reason": reason, "action": self.action,
                 "loss": loss if loss is None or math.isfinite(loss) else str(loss)}
        self.events.append(event)
        self._vetoed.add(id(optimizer))
        optimizer.zero_grad(set_to_none=True)  # the wrapper skips the step; this covers a strategy that bypasses it
        if self.action == "rollback":
            event["restored"] = self._restore(trainer, optimizer)
            self._spikes = 0
        elif self.action == "stop":
            trainer.should_stop = True
        rank_zero_warn(f"DivergenceGuard: step {step}: {reason}; {self._describe(event)}.")
        pl_module.log("guard/events", float(len(self.events)), on_step=True, on_epoch=False)

    @staticmethod
    def _agree(trainer: Trainer, loss: float | None, non_finite_grad: bool) -> tuple[float | None, int, bool]:
        """The mean loss over the ranks, how many saw a non-finite loss, and whether any saw a non-finite gradient."""
        finite = loss is not None and math.isfinite(loss)
        if trainer.world_size == 1:
            return loss, int(loss is not None and not finite), non_finite_grad
        flags = torch.tensor([float(loss is not None), loss if finite else 0.0, float(loss is not None and not finite),
                              float(non_finite_grad)], dtype=torch.float64, device=trainer.strategy.root_device)
        # One all-reduce, whose result is the same on every rank: so are the statistic and the decision.
        counted, total, non_finite, bad_grad = trainer.strategy.reduce(flags, reduce_op="sum").tolist()
        if non_finite:
            return math.nan, int(non_finite), bad_grad > 0
        return (total / counted if counted else None), 0, bad_grad > 0

    def _judge(self, loss: float | None, non_finite_loss: int, non_finite_grad: bool,
               world: int = 1) -> tuple[str | None, bool]:
        """Updates the running statistic; returns the reason to act (``None``: none) and whether there was no spike."""
        if non_finite_loss:
            where = f" on {non_finite_loss} of {world} processes" if world > 1 else ""
            return f"non-finite loss {loss}{where}", False
        if non_finite_grad:
            return "non-finite gradient", False
        spike = None
        if loss is not None and self._good_steps >= self.warmup and self._losses:
            median = statistics.median(self._losses)
            if median > 0 and loss > self.spike_factor * median:
                spike = f"loss spike {loss:.4g} > {self.spike_factor:g} x running median {median:.4g}"
        self._spikes = self._spikes + 1 if spike else 0
        if spike and self._spikes >= self.patience:
            return spike + (f" for {self._spikes} consecutive steps" if self.patience > 1 else ""), False
        if loss is not None:
            self._losses.append(loss)
        return None, spike is None

    def _describe(self, event: dict[str, Any]) -> str:
        if event.get("restored") is not None:
            return (f"rolled back to the state after step {event['restored']} and multiplied the learning rates by "
                    f"{self.lr_factor:g}")
        return {"skip": "the update was skipped", "stop": "the update was skipped and training stops",
                "rollback": "no snapshot yet: the update was skipped"}[self.action]

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
                if p.requires_grad:  # a parameter frozen since the snapshot (ProgressiveFreezing) stays as frozen
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

    def state_dict(self) -> dict[str, Any]:
        return {"events": list(self.events), "losses": list(self._losses), "good_steps": self._good_steps,
                "spikes": self._spikes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict["events"])
        self._losses = deque(state_dict["losses"], maxlen=self.window)
        self._good_steps = int(state_dict["good_steps"])
        self._spikes = int(state_dict.get("spikes", 0))  # absent from states saved before `patience` existed


def _has_non_finite_gradient(optimizer: Optimizer) -> bool:
    # A sharded (DTensor) gradient is checked on this rank's shard; the ranks' answers are then all-reduced.
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    # One fused norm and one read-back; a NaN or an infinity anywhere makes the total non-finite.
    return bool(grads) and not bool(torch.nn.utils.get_total_norm(grads).isfinite())
