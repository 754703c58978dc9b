"""``FitScopedCallback``: a callback that changes the model for one fit and undoes it when fit ends, fails or is interrupted."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback


class FitScopedCallback(Callback):
    """Calls :meth:`_release` when fit ends (``teardown``) or raises (``on_exception``); subclasses undo there
    whatever they installed (idempotently: both hooks may run)."""

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        raise NotImplementedError
