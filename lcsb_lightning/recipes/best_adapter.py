"""Write the adapter of the best evaluation beside the last one: several epochs over a small data set overfit,
so the adapter a run ends with is not its best. No copy is held in memory between evaluations (a rank-16
adapter of SmolLM2-135M is 18.6 MiB); a checkpoint carries the written tensors, so a resumed run writes the
folder back as it was at that checkpoint."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from lcsb_lightning.export import save_gguf_adapter
from lcsb_lightning.recipes.outputs import save_adapter

MODES = ("min", "max")
#: The file ``save_pretrained`` writes an adapter's tensors to.
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def save_adapters(model: nn.Module, path: Path, gguf_base: str | Path | None = None) -> None:
    """The adapter folder ``path`` and, with ``gguf_base`` (the base model's GGUF), ``path.gguf`` for llama.cpp."""
    save_adapter(model, path)
    if gguf_base is not None:
        save_gguf_adapter(model, gguf_base, path.with_name(path.name + ".gguf"))


class BestAdapter(L.Callback):
    """Write the adapter to ``path`` at every evaluation that improves ``monitor``.

    Every evaluation counts, ``trainer.validate`` before and after ``fit`` included (``ModelCheckpoint`` saves only
    while fitting, so the untrained adapter could never be the best); the sanity check and non-finite values do not.

    Args:
        path: The folder of the best adapter (``PeftModel.from_pretrained(path)`` loads it).
        monitor: The logged metric to compare (``"val/loss"``).
        mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).
        gguf_base: The base model's GGUF file: each write also writes ``path`` + ``.gguf`` (:func:`save_adapters`).

    Example::

        >>> keeper = BestAdapter("adapter_best", monitor="val/loss")
        >>> keeper.best_step is None
        True
    """

    def __init__(self, path: str | Path, monitor: str = "val/loss", mode: str = "min",
                 gguf_base: str | Path | None = None) -> None:
        if not isinstance(path, (str, Path)) or not str(path):
            raise ValueError(f"BestAdapter(path={path!r}): allowed: a folder to write the best adapter to")
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"BestAdapter(monitor={monitor!r}): allowed: the name of a logged metric, such as 'val/loss'")
        if mode not in MODES:
            raise ValueError(f"BestAdapter(mode={mode!r}): allowed: {', '.join(map(repr, MODES))}")
        self.path = Path(path)
        self.monitor = monitor
        self.mode = mode
        self.gguf_base = gguf_base
        self.best_value: float | None = None
        self.best_step: int | None = None
        self._writes = True
        self._to_restore: dict[str, torch.Tensor] = {}  # a checkpoint's best adapter, until a model writes it

    def _improves(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value < self.best_value if self.mode == "min" else value > self.best_value

    def offer(self, model: nn.Module, value: float, step: int) -> bool:
        """Write ``model``'s adapter if ``value`` improves on the best so far; ``True`` if it did."""
        if not math.isfinite(value) or not self._improves(value):
            return False
        if self._writes:
            save_adapters(model, self.path, self.gguf_base)
        self.best_value, self.best_step = value, step
        self._to_restore = {}
        return True

    def restore(self, model: nn.Module) -> None:
        """Write the best adapter of a loaded checkpoint to ``path`` (``model`` lends its peft config and
        gets its own adapter back, whether the write succeeds or not); nothing to do without one."""
        if not self._to_restore:
            return
        if self._writes:
            from peft import get_peft_model_state_dict, set_peft_model_state_dict

            current = {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()}
            try:
                set_peft_model_state_dict(model, self._to_restore)
                save_adapters(model, self.path, self.gguf_base)
            finally:
                set_peft_model_state_dict(model, current)
        self._to_restore = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._writes = trainer.is_global_zero

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.restore(_peft_model(pl_module))  # after Lightning has loaded a checkpoint's callback states

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        self.offer(_peft_model(pl_module), float(value), int(trainer.global_step))

    def _written(self) -> dict[str, torch.Tensor]:
        if self._to_restore:
            return dict(self._to_restore)
        weights = self.path / ADAPTER_WEIGHTS
        if self.best_step is None or not self._writes or not weights.is_file():
            return {}
        from safetensors.torch import load_file

        return load_file(str(weights))  # read back only while a checkpoint is being written

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best_value": self.best_value,
                "best_step": self.best_step, "best_state": self._written()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (state_dict.get("monitor"), state_dict.get("mode")) != (self.monitor, self.mode):
            return  # a checkpoint of a run that compared another metric: start afresh
        self.best_value = state_dict.get("best_value")
        self.best_step = state_dict.get("best_step")
        self._to_restore = dict(state_dict.get("best_state") or {})


def _peft_model(pl_module: L.LightningModule) -> nn.Module:
    model = getattr(pl_module, "model", None)
    if model is None or not hasattr(model, "peft_config"):
        raise TypeError(f"BestAdapter needs a LightningModule whose .model is a peft model; got {type(pl_module).__name__}")
    return model
