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


@pytest.mark.parametrize("options", [["policy=dyadic"], ["policy=grad_norm", "mebp=int4", "guard=rollback"],
                                     ["policy=random", "freeze=progressive", "best_adapter=val/loss"]])
def test_a_recipe_checkpoint_loads_and_resumes(tmp_path: Path, options: list[str]) -> None:
    """Every callback's and plugin's state in a recipe checkpoint is tensors and plain containers."""
    out = tmp_path / "run"
    cfg = compose_cfg([*FAST, "task=pydoc", "task.max_eval_examples=2", "trainer.max_steps=2", *options])
    run_finetune(cfg, out)
    assert check_checkpoint(out / "checkpoints" / "last.ckpt")["global_step"] == 2
    cfg.resume, cfg.trainer.max_steps = str(out), 3
    assert run_finetune(cfg, out)["steps"] == 3
