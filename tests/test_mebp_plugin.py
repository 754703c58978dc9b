"""QuantizedMeBP in a Trainer: conversion, logging, LCSB composition, mmap offload cleanup."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader, TensorDataset

from _mebp_utils import add_lora, tiny_llama, tokens
from lcsb_lightning.mebp import QuantizedMeBP, mebp_state
from lcsb_lightning.mebp.layer import CompressedLinear


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class LoraModule(LightningModule):
    def __init__(self, fail_at: int | None = None, interrupt: bool = False) -> None:
        super().__init__()
        self.model = add_lora(tiny_llama())
        self.fail_at = fail_at
        self.interrupt = interrupt
        self.max_offload_files = 0
        self.strict_loading = False  # checkpoints hold LoRA weights; compressed weights come from the source

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(ids, labels=ids).loss
        path = self.trainer.precision_plugin.offload_path
        if path is not None:
            self.max_offload_files = max(self.max_offload_files, len(os.listdir(path)))
        if self.fail_at is not None and batch_idx == self.fail_at:
            if self.interrupt:
                raise KeyboardInterrupt
            raise RuntimeError("boom mid-step")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(tokens(batch=8, seq=16)), batch_size=2)


def _trainer(tmp_path: Path, plugin: QuantizedMeBP, max_steps: int = 3, **kwargs: Any) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, plugins=[plugin], default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, **kwargs,
    )


def _files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def test_fit_converts_trains_and_logs_decompression_times(tmp_path: Path) -> None:
    module = LoraModule()
    logger = MemoryLogger()
    plugin = QuantizedMeBP(fmt="int4", group_size=32)
    before = {n: p.clone() for n, p in module.named_parameters() if p.requires_grad}
    _trainer(tmp_path, plugin, logger=logger, enable_checkpointing=False).fit(module)
    assert sum(isinstance(m, CompressedLinear) for m in module.modules()) == 4 * 7 + 1
    assert any(not torch.equal(before[n], p) for n, p in module.named_parameters() if p.requires_grad)
    logged = [m for m in logger.metrics if "mebp/decompress_bwd_ms" in m]
    assert len(logged) == 3
    for metrics in logged:
        assert metrics["mebp/decompress_fwd_count"] == 4 * 7 + 2  # block Linears, embedding, LM head
        assert metrics["mebp/decompress_bwd_count"] == 4 * 7 + 1
        assert metrics["mebp/recompute_ms"] > 0 and metrics["mebp/backward_ms"] > metrics["mebp/recompute_ms"]
        assert 0 < metrics["mebp/decompress_share_bwd"] < 1
    assert plugin.last_metrics.keys() == logged[-1].keys()
    ignored = module._ddp_params_and_buffers_to_ignore  # DDP does not re-broadcast the codes each step
    assert "model.base_model.model.lm_head.weight" in ignored and len(ignored) == 2 * (4 * 7 + 2)


def test_plugin_composes_with_lcsb_callback(tmp_path: Path) -> None:
    from lcsb_lightning.callback import LCSBCallback

    module = LoraModule()
    plugin = QuantizedMeBP(fmt="int4", group_size=32)
    lcsb = LCSBCallback(policy="cyclic", layers_per_step=1, backward="identity")
    _trainer(tmp_path, plugin, max_steps=1, callbacks=[lcsb], enable_checkpointing=False).fit(module)
    # one of four blocks back-propagated: its 7 Linears (at most) plus the LM head decompress in backward
    assert plugin.last_metrics["mebp/decompress_bwd_count"] <= 7 + 1
    assert plugin.last_metrics["mebp/decompress_fwd_count"] == 4 * 7 + 2


def test_mmap_directory_empty_after_fit_and_after_resume(tmp_path: Path) -> None:
    offload_root = tmp_path / "offload"
    offload_root.mkdir()
    module = LoraModule()
    plugin = QuantizedMeBP(fmt="int4", group_size=32, offload="mmap", offload_dir=str(offload_root))
    _trainer(tmp_path / "run", plugin, max_steps=2).fit(module)
    assert module.max_offload_files >= 4  # the 4 blocks' checkpoint inputs went to files during the step
    assert _files_under(offload_root) == []
    checkpoint = next((tmp_path / "run").rglob("*.ckpt"))
    resumed = LoraModule()
    plugin2 = QuantizedMeBP(fmt="int4", group_size=32, offload="mmap", offload_dir=str(offload_root))
    _trainer(tmp_path / "run", plugin2, max_steps=4).fit(resumed, ckpt_path=str(checkpoint))
    assert resumed.trainer.global_step == 4 and resumed.max_offload_files >= 4
    assert _files_under(offload_root) == []
    assert mebp_state(resumed).offload.closed


@pytest.mark.parametrize("interrupt", [False, True])
def test_mmap_directory_empty_after_exception_mid_step(tmp_path: Path, interrupt: bool) -> None:
    offload_root = tmp_path / "offload"
    offload_root.mkdir()
    module = LoraModule(fail_at=1, interrupt=interrupt)
    plugin = QuantizedMeBP(fmt="int4", group_size=32, offload="mmap", offload_dir=str(offload_root))
    trainer = _trainer(tmp_path, plugin, enable_checkpointing=False)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit if interrupt else RuntimeError, match=None if interrupt else "boom mid-step"):
            trainer.fit(module)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT while shutting down
    assert module.max_offload_files >= 4
    assert _files_under(offload_root) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fmt": "q4"}, ValueError, r"`fmt='q4'` is not supported; choose one of 'int4', 'nf4', 'fp4'"),
        ({"offload": "ssd"}, ValueError, r"`offload='ssd'` is not supported; choose one of 'none', 'mmap'"),
        ({"fmt": "fp4", "group_size": 16}, ValueError, r"`group_size=16` is not a bitsandbytes block size"),
    ],
)
def test_plugin_argument_errors(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        QuantizedMeBP(**kwargs)


def test_convert_module_without_linear_raises_type_error() -> None:
    net = torch.nn.Module()
    net.layers = torch.nn.ModuleList(torch.nn.LayerNorm(8) for _ in range(2))
    with pytest.raises(TypeError, match="apply_mebp found no `nn.Linear` to compress in the 2 blocks"):
        QuantizedMeBP(fmt="int4").convert_module(net)
