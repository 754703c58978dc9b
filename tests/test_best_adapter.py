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
def test_keeps_the_adapter_of_the_best_evaluation(tmp_path: Path, mode: str, values: list[float],
                                                  best_index: int) -> None:
    model, keeper = _tiny_peft(), BestAdapter(tmp_path / "adapter_best", "val/loss", mode)
    states = []
    for step, value in enumerate(values):
        states.append(_lora(model))
        keeper.offer(model, value, step * 10)
        _move(model, 0.1)
    assert keeper.best_step == best_index * 10 and keeper.best_value == values[best_index]
    # what it wrote, and what its checkpointed state holds, is the adapter of that evaluation
    held = keeper.state_dict()["best_state"]
    peft_names = {n.replace(".default", ""): n for n in states[best_index]}
    assert held and {peft_names[n] for n in held} == set(states[best_index])
    for name, tensor in held.items():
        assert torch.equal(tensor, states[best_index][peft_names[name]])
    reloaded = PeftModel.from_pretrained(_tiny_peft().get_base_model(), str(tmp_path / "adapter_best"))
    assert all(torch.equal(states[best_index][n], p) for n, p in _lora(reloaded).items())
    assert all(torch.equal(states[-1][n] + 0.1, p) for n, p in _lora(model).items())  # the model's own is untouched


def _tensors_reachable(obj: Any, depth: int = 3) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if depth == 0:
        return []
    children = (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set))
                else vars(obj).values() if hasattr(obj, "__dict__") else ())
    return [t for child in children for t in _tensors_reachable(child, depth - 1)]


def test_holds_no_copy_of_the_adapter_in_memory_while_training(tmp_path: Path) -> None:
    """The best adapter is written when an evaluation improves, never held: on the phone budget a copy of a
    rank-16 adapter for SmolLM2-135M was 18.6 MiB of the run's anonymous peak (docs/log/0.9.md)."""
    model, keeper = _tiny_peft(), BestAdapter(tmp_path / "adapter_best")
    assert keeper.offer(model, 1.0, 5)
    assert (tmp_path / "adapter_best" / "adapter_model.safetensors").is_file()
    assert _tensors_reachable(keeper) == []


def test_a_worse_evaluation_leaves_the_written_adapter_as_it_was(tmp_path: Path) -> None:
    model, keeper = _tiny_peft(), BestAdapter(tmp_path / "adapter_best")
    keeper.offer(model, 1.0, 5)
    written = (tmp_path / "adapter_best" / "adapter_model.safetensors").read_bytes()
    _move(model, 0.5)
    assert not keeper.offer(model, 2.0, 10)
    assert (tmp_path / "adapter_best" / "adapter_model.safetensors").read_bytes() == written


def test_without_an_evaluation_nothing_is_written(tmp_path: Path) -> None:
    keeper = BestAdapter(tmp_path / "adapter_best")
    assert keeper.state_dict()["best_state"] == {}
    assert not (tmp_path / "adapter_best").exists()


def test_a_resumed_run_writes_the_checkpoints_best_back_and_keeps_comparing_with_it(tmp_path: Path) -> None:
    """The checkpoint holds the best adapter's tensors: a run resumed from it restores ``adapter_best`` as it
    was at that checkpoint, even where the interrupted run wrote a later one after it."""
    model, keeper = _tiny_peft(), BestAdapter(tmp_path / "adapter_best")
    at_checkpoint = _lora(model)
    keeper.offer(model, 1.5, 20)
    buffer = io.BytesIO()
    torch.save(keeper.state_dict(), buffer)
    buffer.seek(0)
    _move(model, 1.0)
    keeper.offer(model, 1.2, 30)  # the interrupted run improved after its last checkpoint

    resumed = BestAdapter(tmp_path / "adapter_best")
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert (resumed.best_value, resumed.best_step) == (1.5, 20)
    assert _tensors_reachable(resumed)  # held only until the model is there to write them with
    resumed.restore(model)
    assert _tensors_reachable(resumed) == []
    reloaded = PeftModel.from_pretrained(_tiny_peft().get_base_model(), str(tmp_path / "adapter_best"))
    assert all(torch.equal(at_checkpoint[n], p) for n, p in _lora(reloaded).items())
    assert not resumed.offer(model, 1.6, 40)  # worse than the best before the restart


def test_a_checkpoint_of_another_metric_is_not_loaded(tmp_path: Path) -> None:
    keeper = BestAdapter(tmp_path / "a", "val/loss")
    keeper.offer(_tiny_peft(), 1.5, 20)
    other = BestAdapter(tmp_path / "b", "val/accuracy", "max")
    other.load_state_dict(keeper.state_dict())
    assert other.best_step is None and other.best_value is None and _tensors_reachable(other) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "lowest"}, "BestAdapter(mode='lowest'): allowed: 'min', 'max'"),
        ({"monitor": ""}, "BestAdapter(monitor=''): allowed: the name of a logged metric"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BestAdapter(tmp_path, **kwargs)


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

    keeper, lightning_best = BestAdapter(tmp_path / "adapter_best"), ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_top_k=1)
    trainer = L.Trainer(callbacks=[keeper, lightning_best], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.validate(Evaluated(), DataLoader([torch.zeros(1)]), verbose=False)
    assert (keeper.best_value, keeper.best_step) == (1.0, 0) and (tmp_path / "adapter_best").is_dir()
    assert lightning_best.best_model_path == "" and not list(tmp_path.glob("*.ckpt"))
