"""``freeze=progressive`` and checkpoints: a run preempted after a freeze resumes to exactly the uninterrupted
run; a checkpoint keeps the adapter's tensors whether or not they train at the moment it is written."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback

from _recipes_utils import FAST, compose_cfg, one_thread, write_cls  # noqa: F401
from lcsb_lightning.recipes.checkpointing import Preempted
from lcsb_lightning.recipes.train import run_finetune

STOP_AT = 3  # 2 steps per epoch: step 3 is the first step of epoch 1, the first frozen one


class Losses(Callback):
    """Records every training loss; with ``stop``, sends SIGTERM during step ``STOP_AT`` (the recipe then writes
    ``last.ckpt`` after it and raises :class:`Preempted`)."""

    def __init__(self, stop: bool = False) -> None:
        self.stop, self.losses = stop, []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.stop and trainer.global_step == STOP_AT - 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_a_run_preempted_in_a_frozen_epoch_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    train, evals = write_cls(tmp_path)
    cfg = [*FAST, "task=classification", f"task.train_file={train}", f"task.eval_file={evals}",
           "task.text_column=sentence", "task.verbalizer={0: bad, 1: good}", "task.max_train_examples=4",
           "trainer.max_steps=6", "freeze=progressive", "freeze.schedule=[[1,1]]", "checkpoint_every=100",
           "module.lr=1e-2", "eval_before_training=false"]
    reference = Losses()
    run_finetune(compose_cfg(cfg), tmp_path / "reference", extra_callbacks=[reference])

    out = tmp_path / "run"
    stopped = Losses(stop=True)
    with pytest.raises(Preempted):
        run_finetune(compose_cfg(cfg), out, extra_callbacks=[stopped])
    checkpoint = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == STOP_AT and checkpoint["epoch"] == 1
    frozen_lora = [k for k in checkpoint["state_dict"] if "layers.0." in k]
    assert frozen_lora and all("lora_" in k for k in checkpoint["state_dict"])  # the frozen block's adapter too

    resumed = Losses()
    summary = run_finetune(compose_cfg([*cfg, f"resume={out}"]), out, extra_callbacks=[resumed])
    assert summary["steps"] == 6
    assert stopped.losses + resumed.losses == reference.losses
    a, b = _adapter(out), _adapter(tmp_path / "reference")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
