"""``weights="auto"`` is decided when the training device is known: memory-mapped only for CPU training on a
disk, nothing written for a model that trains elsewhere, no mapping left once the model leaves the CPU."""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from _mebp_utils import add_lora, tiny_config, tiny_llama, tokens
from lcsb_lightning.mebp import MeBPConfig, QuantizedMeBP, load_compressed, mebp_state
from lcsb_lightning.mebp._internal import storage

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _mappings_under(folder: Path) -> int:
    """Live memory mappings of files under ``folder`` (unlinked ones included)."""
    with open("/proc/self/maps") as handle:
        return sum(str(folder) in line for line in handle)


def _files_under(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*"))


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``accelerator(True)``: this machine has an accelerator Lightning would pick."""
    return lambda present: monkeypatch.setattr(storage, "accelerator_available", lambda: present, raising=False)


class Lora(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = add_lora(tiny_llama(num_layers=2))
        self.seen: list[tuple[bool, int]] = []  # (a weight store, its live mappings) at each step

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        store = mebp_state(self).weight_store
        self.seen.append((store is not None, store.live_mappings() if store is not None else 0))
        (ids,) = batch
        return self.model(ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(tokens(batch=4, seq=16)), batch_size=2)


def _fit(module: Lora, plugin: QuantizedMeBP, root: Path) -> None:
    Trainer(accelerator="cpu", devices=1, max_steps=2, plugins=[plugin], default_root_dir=root, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module)


@linux_only
def test_nothing_is_written_or_mapped_for_a_model_that_trains_on_an_accelerator(tmp_path: Path, accelerator: Any) -> None:
    accelerator(True)
    module = Lora()
    plugin = QuantizedMeBP(fmt="int4", group_size=32, offload_dir=str(tmp_path))
    plugin.convert_module(module)  # what Strategy.setup does before it moves the model
    assert _files_under(tmp_path) == [] and _mappings_under(tmp_path) == 0
    module.to("meta")  # the strategy's move to the accelerator, emulated
    plugin.connect(module, [], [])
    plugin.teardown()
    assert mebp_state(module).weight_store is None
    assert _files_under(tmp_path) == [] and _mappings_under(tmp_path) == 0


@linux_only
def test_a_model_that_leaves_the_cpu_drops_its_mappings(tmp_path: Path, accelerator: Any) -> None:
    accelerator(False)  # a CPU-only machine: the conversion maps the weights right away
    module = Lora()
    plugin = QuantizedMeBP(fmt="int4", group_size=32, offload_dir=str(tmp_path))
    plugin.convert_module(module)
    assert _mappings_under(tmp_path) == 2 * (2 * 7 + 1)  # codes and scales of each compressed tensor
    module.to("meta")
    gc.collect()
    assert _mappings_under(tmp_path) == 0  # the store held them alive in 0.8.0
    plugin.connect(module, [], [])
    assert mebp_state(module).weight_store is None and _files_under(tmp_path) == []


@linux_only
def test_weights_auto_maps_them_at_fit_start_for_cpu_training(tmp_path: Path, accelerator: Any) -> None:
    accelerator(True)  # the conversion cannot know the model will train on the CPU: the plugin decides
    module = Lora()
    plugin = QuantizedMeBP(fmt="int4", group_size=32, offload_dir=str(tmp_path / "weights"))
    (tmp_path / "weights").mkdir()
    _fit(module, plugin, tmp_path / "run")
    assert module.seen == [(True, 2 * (2 * 7 + 1))] * 2
    assert _files_under(tmp_path / "weights") == []  # the directory went at teardown
    state = mebp_state(module)  # the model still trains or evaluates on its mapped weights after fit
    assert all(state.weight_store.owns(layer.weight) for layer in state.compressed_modules.values())


def test_weights_auto_keeps_them_in_ram_on_a_ram_file_system(tmp_path: Path, accelerator: Any,
                                                             monkeypatch: pytest.MonkeyPatch, recwarn: Any) -> None:
    accelerator(False)
    monkeypatch.setattr(storage, "filesystem_type", lambda path: "tmpfs")
    module = Lora()
    _fit(module, QuantizedMeBP(fmt="int4", group_size=32, offload_dir=str(tmp_path)), tmp_path / "run")
    assert module.seen == [(False, 0)] * 2
    assert not [w for w in recwarn if "RAM file system" in str(w.message)]


@pytest.mark.parametrize(("present", "mapped"), [(False, True), (True, False)])
def test_load_compressed_maps_cpu_weights_where_no_accelerator_would_train_them(accelerator: Any, present: bool,
                                                                               mapped: bool) -> None:
    accelerator(present)
    state = mebp_state(load_compressed(tiny_config(num_layers=1), fmt="int4", group_size=32))
    assert (state.weight_store is not None) == (mapped and storage.mmap_supported())


def test_building_a_config_logs_nothing_and_the_auto_decision_is_logged_once(monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    from lcsb_lightning.mebp import config as config_module

    monkeypatch.setattr(config_module, "mmap_supported", lambda: False)
    monkeypatch.setattr(storage, "mmap_supported", lambda: False, raising=False)
    monkeypatch.setattr(storage, "_auto_reasons_logged", set(), raising=False)
    with caplog.at_level(logging.INFO):
        configs = [MeBPConfig(fmt="int4") for _ in range(3)]
        assert caplog.records == [], [r.getMessage() for r in caplog.records]
        assert {c.weights for c in configs} == {"auto"}  # as given: a saved config replays the same decision
        for _ in range(3):
            assert not storage.maps_for_training("auto", torch.device("cpu"), None)
    assert [r.getMessage() for r in caplog.records] == [
        "QuantizedMeBP: weights='auto' keeps the compressed weights in RAM: this platform has no madvise."
    ]
