"""What ``CausalLMModule.on_save_checkpoint`` keeps and ``on_load_checkpoint`` restores: the adapter's tensors
(every one the run trains, frozen for a while or not) and the random states: torch's CPU one, every CUDA
device's, Python's and numpy's (CUDA simulated on the CPU)."""

from __future__ import annotations

import io
import random
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch

from lcsb_lightning.recipes.module import CausalLMModule
from lcsb_lightning.recipes.tasks.base import Task


@cache
def _module() -> CausalLMModule:
    """A tiny Llama with LoRA on its attention's query and value projections."""
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return CausalLMModule(LlamaForCausalLM(config), None, Task(), lora=LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))


def _save() -> dict[str, Any]:
    module = _module()
    checkpoint: dict[str, Any] = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    return checkpoint


def _load(checkpoint: dict[str, Any]) -> None:
    _module().on_load_checkpoint(checkpoint)


@pytest.mark.parametrize("frozen_now", [[], ["layers.0."], ["layers.0.", "layers.1."]])
def test_the_checkpoint_keeps_every_adapter_tensor_whatever_trains_now(frozen_now: list[str]) -> None:
    """ProgressiveFreezing turns ``requires_grad`` off for the adapter of its frozen blocks during fit; they are
    trained weights all the same, and a resume needs them."""
    module = _module()
    adapter = {name for name, _ in module.named_parameters() if "lora_" in name}
    assert len(adapter) == 8
    for name, p in module.named_parameters():
        p.requires_grad_(name in adapter and not any(part in name for part in frozen_now))
    try:
        checkpoint = _save()
    finally:
        for name, p in module.named_parameters():
            p.requires_grad_(name in adapter)
    assert set(checkpoint["state_dict"]) == adapter
    _load(checkpoint)  # complete: accepted
    checkpoint["state_dict"].pop(sorted(adapter)[0])
    with pytest.raises(ValueError, match="lacks 1 trainable tensors"):
        _load(checkpoint)


def _draws() -> tuple[float, float, float]:
    return float(torch.rand(1)), random.random(), float(np.random.rand())


def test_cpu_python_and_numpy_states_are_restored() -> None:
    checkpoint = _save()
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)  # as Lightning may load it: no numpy arrays inside
    first = _draws()
    _load(checkpoint)
    assert _draws() == first


def test_a_checkpoint_without_cuda_and_numpy_states_still_loads() -> None:
    checkpoint = _save()
    checkpoint["rng_states"] = {k: checkpoint["rng_states"][k] for k in ("torch", "python")}  # written by 0.3.0
    first = float(torch.rand(1))
    _load(checkpoint)
    assert float(torch.rand(1)) == first


@pytest.mark.parametrize("devices_now", [2, 1])
def test_every_cuda_device_state_is_saved_and_restored(monkeypatch: pytest.MonkeyPatch, devices_now: int) -> None:
    saved = [torch.full((4,), 1, dtype=torch.uint8), torch.full((4,), 2, dtype=torch.uint8)]
    restored: list[tuple[int, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in saved])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices_now)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append((int(state[0]), device)))
    checkpoint = _save()
    assert [s.tolist() for s in checkpoint["rng_states"]["cuda"]] == [s.tolist() for s in saved]
    _load(checkpoint)
    assert restored == [(1, 0), (2, 1)][:devices_now]  # each device its own state; fewer devices: the first ones


def test_no_cuda_call_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(*args: Any) -> None:
        raise AssertionError("CUDA was touched")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", unavailable)
    monkeypatch.setattr(torch.cuda, "set_rng_state", unavailable)
    checkpoint = _save()
    checkpoint["rng_states"]["cuda"] = [torch.zeros(4, dtype=torch.uint8)]  # from a GPU machine, resumed on a CPU one
    _load(checkpoint)
