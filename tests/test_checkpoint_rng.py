"""The random states in a recipe checkpoint: torch's CPU one, every CUDA device's, Python's and numpy's, saved by
``CausalLMModule.on_save_checkpoint`` and restored by ``on_load_checkpoint`` (CUDA simulated on the CPU)."""

from __future__ import annotations

import io
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from lcsb_lightning.recipes.module import CausalLMModule

FAKE = SimpleNamespace(_trainable_keys=lambda: set())  # a module without trainable tensors: only the RNG part runs


def _save() -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"state_dict": {}}
    CausalLMModule.on_save_checkpoint(FAKE, checkpoint)  # type: ignore[arg-type]
    return checkpoint


def _load(checkpoint: dict[str, Any]) -> None:
    CausalLMModule.on_load_checkpoint(FAKE, checkpoint)  # type: ignore[arg-type]


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
