"""The backward modes' names before 0.5 (``exact``, ``truncated``), deprecated in 0.5, are refused since 0.6;
a 0.4 checkpoint, whose state key holds the old name, still resumes."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lcsb_lightning import LCSBCallback, SelectiveBackprop
from lcsb_lightning.controller import BACKWARD_MODES, LCSBController
from lcsb_lightning.policies import CyclicPolicy
from tests.conftest import TokenLM, quiet_trainer, token_batches

BUILD: dict[str, Callable[[nn.Module, str], Any]] = {
    "LCSBCallback": lambda net, backward: LCSBCallback("cyclic", layers_per_step=1, backward=backward),
    "LCSBController": lambda net, backward: LCSBController(net, CyclicPolicy(layers_per_step=1), backward=backward),
    "SelectiveBackprop": lambda net, backward: SelectiveBackprop(list(net.stack), backward=backward),
}


def _release(built: Any) -> None:
    if isinstance(built, (LCSBController, SelectiveBackprop)):
        built.release() if isinstance(built, LCSBController) else built.remove()


@pytest.mark.parametrize("entry", sorted(BUILD))
@pytest.mark.parametrize("old", ["truncated", "exact"])
def test_the_names_before_0_5_are_refused(residual_net, entry: str, old: str) -> None:
    allowed = "identity, selected_only" if entry == "SelectiveBackprop" else ", ".join(BACKWARD_MODES)
    with pytest.raises(ValueError, match=rf"`backward='{old}'` is not supported; allowed: {allowed}\.$"):
        BUILD[entry](residual_net(num_blocks=2), old)


@pytest.mark.parametrize("entry", sorted(BUILD))
def test_the_current_names_do_not_warn(residual_net, entry: str) -> None:
    names = ("identity", "selected_only") if entry == "SelectiveBackprop" else BACKWARD_MODES
    for backward in names:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            built = BUILD[entry](residual_net(num_blocks=2), backward)
        assert built.backward == backward
        _release(built)


def test_a_checkpoint_of_0_4_keyed_by_the_old_name_resumes_the_sequence(residual_net, tmp_path: Path) -> None:
    def run(steps: int, backward: str, ckpt_path: Path | None = None, save: bool = False) -> LCSBCallback:
        model = TokenLM(residual_net(num_blocks=4, seed=0), lr=0.02)
        lcsb = LCSBCallback("random", layers_per_step=1, backward=backward, seed=7, log_every_n_steps=0)
        callbacks: list[Any] = [lcsb]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4))
        trainer = quiet_trainer(max_steps=steps, callbacks=callbacks, enable_checkpointing=save)
        trainer.fit(model, token_batches(num_batches=4), ckpt_path=ckpt_path)
        return lcsb

    full = run(8, "all_reached")
    run(4, "all_reached", save=True)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if "LCSBCallback" in k]
    old_key = key.replace("'all_reached'", "'truncated'")
    assert old_key != key
    checkpoint["callbacks"][old_key] = checkpoint["callbacks"].pop(key)  # as 0.4 keyed it
    torch.save(checkpoint, tmp_path / "v0.4.ckpt")
    resumed = run(8, "all_reached", ckpt_path=tmp_path / "v0.4.ckpt")
    assert resumed.selection_counts == full.selection_counts  # the counts of steps 0-3 came from the checkpoint
