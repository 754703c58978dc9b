"""``resume=`` loads a checkpoint with ``torch.load(weights_only=True)``: tensors and plain containers only, never
code that unpickling a file would run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _recipes_utils import FAST, compose_cfg, one_thread  # noqa: F401
from lcsb_lightning.recipes.checkpointing import check_checkpoint
from lcsb_lightning.recipes.train import run_finetune

RAN: list[str] = []


def _run_on_load(note: str) -> str:
    RAN.append(note)
    return note


class Payload:
    """Unpickling it calls a function: what an untrusted checkpoint could run."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _run_on_load, ("ran",)


def test_a_checkpoint_that_runs_code_on_load_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "global_step": 1, "extra": Payload()}, path)
    RAN.clear()
    with pytest.raises(ValueError, match="last.ckpt"):
        check_checkpoint(path)
    assert RAN == []


def _frozen(checkpoint: dict[str, Any]) -> list[int]:
    """The blocks ProgressiveFreezing had frozen when the checkpoint was saved (empty without it)."""
    return [state["frozen"] for key, state in checkpoint["callbacks"].items() if key.startswith("ProgressiveFreezing")]


@pytest.mark.parametrize(("options", "frozen"), [
    (["policy=dyadic"], []),
    (["policy=grad_norm", "mebp=int4", "guard=rollback"], []),
    # 3 steps an epoch: step 3 runs in epoch 1 with the lowest half of the blocks frozen; the resumed run
    # starts epoch 2 (a run stopped by max_steps saves its epoch as done), three quarters
    (["policy=random", "freeze=progressive", "task.max_train_examples=6", "best_adapter=val/loss"], [2, 3]),
])
def test_a_recipe_checkpoint_loads_and_resumes(tmp_path: Path, options: list[str], frozen: list[int]) -> None:
    """Every callback's and plugin's state in a recipe checkpoint is tensors and plain containers, frozen blocks
    included."""
    out = tmp_path / "run"
    cfg = compose_cfg([*FAST, "task=pydoc", "task.max_eval_examples=2", "trainer.max_steps=4", *options])
    run_finetune(cfg, out)
    checkpoint = check_checkpoint(out / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == 4 and _frozen(checkpoint) == frozen[:1]
    cfg.resume, cfg.trainer.max_steps = str(out), 5
    assert run_finetune(cfg, out)["steps"] == 5
    checkpoint = check_checkpoint(out / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == 5 and _frozen(checkpoint) == frozen[1:]
