"""BestAdapter: which evaluation's adapter it keeps, what it writes, its state, and bad arguments."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lcsb_lightning.recipes.best_adapter import BestAdapter


def _tiny_peft() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))


def _lora(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _move(model: Any, amount: float) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(amount)


@pytest.mark.parametrize(
    ("mode", "values", "best_index"),
    [
        ("min", [3.0, 2.0, 2.5, 2.2], 1),
        ("min", [1.0, 2.0, 3.0], 0),  # the evaluation before training stays the best
        ("min", [3.0, math.nan, 2.9, math.inf], 2),  # non-finite values are never the best
        ("max", [0.5, 0.8, 0.7], 1),
        ("min", [2.0, 2.0, 1.5, 1.5], 2),  # a tie keeps the earlier
    ],
)
def test_keeps_the_adapter_of_the_best_evaluation(mode: str, values: list[float], best_index: int) -> None:
    model, keeper = _tiny_peft(), BestAdapter("val/loss", mode)
    states = []
    for step, value in enumerate(values):
        states.append(_lora(model))
        keeper.offer(model, value, step * 10)
        _move(model, 0.1)
    assert keeper.best_step == best_index * 10 and keeper.best_value == values[best_index]
    # what it holds is the adapter of that evaluation
    held = keeper.state_dict()["best_state"]
    peft_names = {n.replace(".default", ""): n for n in states[best_index]}
    assert held and {peft_names[n] for n in held} == set(states[best_index])
    for name, tensor in held.items():
        assert torch.equal(tensor, states[best_index][peft_names[name]])


def test_save_writes_the_best_adapter_and_puts_the_current_one_back(tmp_path: Path) -> None:
    model, keeper = _tiny_peft(), BestAdapter()
    best = _lora(model)
    keeper.offer(model, 1.0, 5)
    _move(model, 0.5)
    keeper.offer(model, 2.0, 10)  # worse: not kept
    current = _lora(model)
    keeper.save(model, tmp_path / "adapter_best")

    assert all(torch.equal(current[n], p) for n, p in _lora(model).items())
    reloaded = PeftModel.from_pretrained(_tiny_peft().get_base_model(), str(tmp_path / "adapter_best"))
    assert all(torch.equal(best[n], p) for n, p in _lora(reloaded).items())


def test_save_without_an_evaluation_writes_nothing(tmp_path: Path) -> None:
    assert BestAdapter().save(_tiny_peft(), tmp_path / "adapter_best") is None
    assert not (tmp_path / "adapter_best").exists()


def test_state_dict_survives_a_checkpoint_and_a_resumed_run_keeps_its_best() -> None:
    model, keeper = _tiny_peft(), BestAdapter()
    keeper.offer(model, 1.5, 20)
    buffer = io.BytesIO()
    torch.save(keeper.state_dict(), buffer)
    buffer.seek(0)

    resumed = BestAdapter()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert (resumed.best_value, resumed.best_step) == (1.5, 20)
    _move(model, 1.0)
    assert not resumed.offer(model, 1.6, 30)  # worse than the best before the restart
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict()["best_state"].values(),
                                                 keeper.state_dict()["best_state"].values()))


def test_a_checkpoint_of_another_metric_is_not_loaded() -> None:
    keeper = BestAdapter("val/loss")
    keeper.offer(_tiny_peft(), 1.5, 20)
    other = BestAdapter("val/accuracy", "max")
    other.load_state_dict(keeper.state_dict())
    assert other.best_step is None and other.best_value is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "lowest"}, "BestAdapter(mode='lowest'): allowed: 'min', 'max'"),
        ({"monitor": ""}, "BestAdapter(monitor=''): allowed: the name of a logged metric"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BestAdapter(**kwargs)


def test_the_evaluation_before_training_counts_where_lightnings_model_checkpoint_skips_it(tmp_path: Path) -> None:
    """Why BestAdapter is not ``ModelCheckpoint(monitor=..., save_top_k=1)``: that one saves only inside ``fit``,
    so the evaluation before training (the untrained adapter, the best when training only hurts) never counts."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    class Evaluated(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _tiny_peft()

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.log("val/loss", batch.sum() + 1.0)

    keeper, lightning_best = BestAdapter(), ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_top_k=1)
    trainer = L.Trainer(callbacks=[keeper, lightning_best], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.validate(Evaluated(), DataLoader([torch.zeros(1)]), verbose=False)
    assert (keeper.best_value, keeper.best_step) == (1.0, 0)
    assert lightning_best.best_model_path == "" and not list(tmp_path.glob("*.ckpt"))
