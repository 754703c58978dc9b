"""QuantizedMeBP leaves Lightning's gradient semantics alone: every hook and a manual-optimization module see the
gradients they see without the plugin; freeing them early is the explicit ``free_grads_after_step``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from _mebp_utils import add_lora, tiny_llama, tokens
from lcsb_lightning.mebp import QuantizedMeBP

HOOKS = ("on_train_batch_start", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
         "on_train_batch_end")
STEPS = 3
LORA_PARAMS = 4 * 7 * 2  # A and B of the 7 projections of 4 blocks


def _gradients(module: LightningModule) -> tuple[int, int]:
    """``(LoRA parameters holding a gradient, of which non-zero)``."""
    grads = [p.grad for n, p in module.named_parameters() if "lora_" in n]
    return sum(g is not None for g in grads), sum(g is not None and bool(g.any()) for g in grads)


class GradientProbe(Callback):
    """What each hook of each step sees."""

    def __init__(self) -> None:
        self.seen: dict[str, list[tuple[int, int]]] = {hook: [] for hook in HOOKS}

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, *args: Any) -> None:
        self.seen["on_train_batch_start"].append(_gradients(module))

    def on_after_backward(self, trainer: Trainer, module: LightningModule) -> None:
        self.seen["on_after_backward"].append(_gradients(module))

    def on_before_optimizer_step(self, trainer: Trainer, module: LightningModule, *args: Any) -> None:
        self.seen["on_before_optimizer_step"].append(_gradients(module))

    def on_before_zero_grad(self, trainer: Trainer, module: LightningModule, *args: Any) -> None:
        self.seen["on_before_zero_grad"].append(_gradients(module))

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, *args: Any) -> None:
        self.seen["on_train_batch_end"].append(_gradients(module))


class Lora(LightningModule):
    def __init__(self, manual: bool = False, keep_zeroed: bool = False) -> None:
        super().__init__()
        self.model = add_lora(tiny_llama())
        self.automatic_optimization = not manual
        self.keep_zeroed = keep_zeroed
        self.after_step: list[tuple[int, int]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        (ids,) = batch
        loss = self.model(ids, labels=ids).loss
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.after_step.append(_gradients(self))
        return None

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if self.keep_zeroed:  # a user's override: zeroed gradients stay allocated
            optimizer.zero_grad(set_to_none=False)
        else:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(tokens(batch=2 * STEPS, seq=16)), batch_size=2)


def _fit(tmp_path: Path, module: Lora, plugin: QuantizedMeBP | None) -> GradientProbe:
    probe = GradientProbe()
    Trainer(accelerator="cpu", devices=1, max_steps=STEPS, plugins=[plugin] if plugin else None, callbacks=[probe],
            default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False).fit(module)
    return probe


@pytest.mark.parametrize("keep_zeroed", [False, True], ids=["default_zero_grad", "set_to_none_false_override"])
def test_every_hook_sees_the_gradients_it_sees_without_the_plugin(tmp_path: Path, keep_zeroed: bool) -> None:
    plain = _fit(tmp_path / "plain", Lora(keep_zeroed=keep_zeroed), None).seen
    mebp = _fit(tmp_path / "mebp", Lora(keep_zeroed=keep_zeroed), QuantizedMeBP(fmt="int4", group_size=32)).seen
    assert plain["on_train_batch_end"] == [(LORA_PARAMS, LORA_PARAMS)] * STEPS  # the probe sees real gradients
    differ = {hook: f"{mebp[hook]} with the plugin, {plain[hook]} without" for hook in HOOKS if mebp[hook] != plain[hook]}
    assert not differ, differ


@pytest.mark.parametrize("options", [{}, {"free_grads_after_step": True}], ids=["defaults", "free_grads_after_step"])
def test_manual_optimization_keeps_its_gradients_after_the_step(tmp_path: Path, options: dict) -> None:
    plain, mebp = Lora(manual=True), Lora(manual=True)
    _fit(tmp_path / "plain", plain, None)
    _fit(tmp_path / "mebp", mebp, QuantizedMeBP(fmt="int4", group_size=32, **options))
    assert plain.after_step == [(LORA_PARAMS, LORA_PARAMS)] * STEPS
    assert mebp.after_step == plain.after_step  # the option is for automatic optimization only


def test_free_grads_after_step_frees_them_right_after_the_optimizer_step(tmp_path: Path) -> None:
    seen = _fit(tmp_path, Lora(), QuantizedMeBP(fmt="int4", group_size=32, free_grads_after_step=True)).seen
    assert seen["on_before_optimizer_step"] == [(LORA_PARAMS, LORA_PARAMS)] * STEPS
    assert seen["on_train_batch_end"] == [(0, 0)] * STEPS
    assert seen["on_train_batch_start"] == [(0, 0)] * STEPS  # not held through the next forward
