"""Keep the adapter of the best evaluation beside the last one.

Several epochs over a small data set overfit: the eval loss reaches its lowest value and then rises
while the training loss keeps falling, so the adapter a run ends with is not its best. ``BestAdapter``
copies the adapter's tensors (``peft.get_peft_model_state_dict``: the LoRA weights and any
``modules_to_save``, a few MB) whenever an evaluation improves on the best so far, and
:meth:`BestAdapter.save` writes that copy as a complete peft adapter. The copy is part of the
callback's ``state_dict``, so a resumed run still knows its best evaluation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from lcsb_lightning.recipes.outputs import save_adapter

MODES = ("min", "max")


class BestAdapter(L.Callback):
    """Copy the adapter at every evaluation that improves ``monitor``; :meth:`save` writes the best one.

    Every evaluation counts, ``trainer.validate`` before and after ``fit`` included (an evaluation
    before any training that stays the best yields the untrained adapter); the sanity check does not.
    An evaluation without the metric, or with a non-finite value, is ignored.

    Not Lightning's ``ModelCheckpoint(monitor=..., mode=..., save_top_k=1)`` plus an export: that one saves
    only while fitting (``_should_skip_saving_checkpoint``: ``trainer.state.fn != FITTING``), so the
    evaluation before training, the best one when training only hurts, would never count; and each
    improvement would write a whole checkpoint (optimizer state, loops) to read back at the end, where a
    copy of the adapter in memory, checkpointed with this callback's state, is all that is needed.

    Args:
        monitor: The logged metric to compare (``"val/loss"``).
        mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).

    Example::

        >>> keeper = BestAdapter("val/loss")
        >>> keeper.best_step is None
        True
    """

    def __init__(self, monitor: str = "val/loss", mode: str = "min") -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"BestAdapter(monitor={monitor!r}): allowed: the name of a logged metric, such as 'val/loss'")
        if mode not in MODES:
            raise ValueError(f"BestAdapter(mode={mode!r}): allowed: {', '.join(map(repr, MODES))}")
        self.monitor = monitor
        self.mode = mode
        self.best_value: float | None = None
        self.best_step: int | None = None
        self._best_state: dict[str, torch.Tensor] = {}

    def _improves(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value < self.best_value if self.mode == "min" else value > self.best_value

    def offer(self, model: nn.Module, value: float, step: int) -> bool:
        """Keep a copy of ``model``'s adapter if ``value`` improves on the best so far; ``True`` if it did."""
        if not math.isfinite(value) or not self._improves(value):
            return False
        from peft import get_peft_model_state_dict

        self._best_state = {name: tensor.detach().to("cpu", copy=True)
                            for name, tensor in get_peft_model_state_dict(model).items()}
        self.best_value, self.best_step = value, step
        return True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        self.offer(_peft_model(pl_module), float(value), int(trainer.global_step))

    def save(self, model: nn.Module, path: Path) -> Path | None:
        """Write the best adapter to ``path`` as a complete peft adapter (``None``: no evaluation yet).

        ``model``'s own adapter is put back afterwards, whether the save succeeds or not.
        """
        if not self._best_state:
            return None
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        current = {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()}
        try:
            set_peft_model_state_dict(model, self._best_state)
            return save_adapter(model, path)
        finally:
            set_peft_model_state_dict(model, current)

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best_value": self.best_value,
                "best_step": self.best_step, "best_state": dict(self._best_state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (state_dict.get("monitor"), state_dict.get("mode")) != (self.monitor, self.mode):
            return  # a checkpoint of a run that compared another metric: start afresh
        self.best_value = state_dict.get("best_value")
        self.best_step = state_dict.get("best_step")
        self._best_state = dict(state_dict.get("best_state") or {})


def _peft_model(pl_module: L.LightningModule) -> nn.Module:
    model = getattr(pl_module, "model", None)
    if model is None or not hasattr(model, "peft_config"):
        raise TypeError(f"BestAdapter needs a LightningModule whose .model is a peft model; got {type(pl_module).__name__}")
    return model
