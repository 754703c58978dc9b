"""``mebp=int4|nf4`` with the trainer config's precision: QuantizedMeBP takes ``trainer.precision`` (bf16-mixed runs the
steps under bfloat16 autocast; float32 stays as it was) and refuses one it cannot run with, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _recipes_utils import FAST, compose_cfg, one_thread  # noqa: F401
from lcsb_lightning.mebp import QuantizedMeBP
from lcsb_lightning.recipes.train import build_trainer, run_finetune


@pytest.mark.parametrize(("given", "expected"), [("32-true", "32-true"), ("bf16-mixed", "bf16-mixed"), ("bf16", "bf16-mixed")])
def test_the_trainer_precision_reaches_the_plugin(tmp_path: Path, given: str, expected: str) -> None:
    trainer, _ = build_trainer(compose_cfg([*FAST, "mebp=int4", f"trainer.precision={given}"]), tmp_path)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, QuantizedMeBP) and plugin.precision == expected and trainer.precision == expected


def test_forward_context_autocasts_only_with_bf16_mixed() -> None:
    with QuantizedMeBP(fmt="int4").forward_context():
        assert not torch.is_autocast_enabled("cpu")  # float32: what a CPU step computes is unchanged
    with QuantizedMeBP(fmt="int4", precision="bf16-mixed").forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.nn.functional.linear(torch.ones(2, 4), torch.ones(3, 4)).dtype == torch.bfloat16


def test_an_unsupported_precision_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"QuantizedMeBP: precision='16-mixed' is not supported; allowed: 32-true, bf16-mixed"):
        QuantizedMeBP(fmt="int4", precision="16-mixed")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"trainer.precision='16-mixed' with mebp \(QuantizedMeBP\) is not supported; "
                                         r"allowed: 32-true, bf16-mixed"):
        run_finetune(compose_cfg([*FAST, "task=pydoc", "mebp=int4", "trainer.precision=16-mixed"]), out)
    assert not out.exists()  # refused before the model is loaded


def test_bf16_mixed_int4_run_on_cpu(tmp_path: Path) -> None:
    summary = run_finetune(compose_cfg([*FAST, "task=pydoc", "task.max_eval_examples=2", "mebp=int4",
                                        "trainer.precision=bf16-mixed", "trainer.max_steps=2"]), tmp_path / "run")
    assert summary["steps"] == 2 and summary["config"]["trainer"]["precision"] == "bf16-mixed"
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["final_metrics"].values())
