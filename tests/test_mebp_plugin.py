"""QuantizedMeBP in a Trainer: conversion, logging, LCSB composition, mmap offload cleanup."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader, TensorDataset

from _mebp_utils import add_lora, tiny_llama, tokens
from lcsb_lightning.mebp import QuantizedMeBP, mebp_state
from lcsb_lightning.mebp.compressed import CompressedLinear


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


class BlockGrads(Callback):
    """Per block: backward decompressions of its compressed Linears and whether its LoRA got a gradient."""

    def __init__(self) -> None:
        self.backward_counts: list[int] = []
        self.lora_grad: list[bool] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        for layer in pl_module.model.base_model.model.model.layers:
            linears = [m for m in layer.modules() if isinstance(m, CompressedLinear)]
            self.backward_counts.append(sum(m.decompress_count["backward"] for m in linears))
            self.lora_grad.append(any(p.grad is not None and bool(p.grad.any()) for n, p in layer.named_parameters() if "lora_" in n))


@pytest.mark.parametrize("plugin_first", [True, False])
def test_plugin_composes_with_lcsb_callback(tmp_path: Path, plugin_first: bool) -> None:
    from lcsb_lightning.callback import LCSBCallback

    torch.manual_seed(0)
    module = LoraModule()
    for name, p in module.named_parameters():  # non-zero LoRA B: every selected LoRA weight gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    plugin = QuantizedMeBP(fmt="int4", group_size=32)
    if plugin_first:
        plugin.convert_module(module)
    reference = _eval_logits(module) if plugin_first else None
    lcsb = LCSBCallback(policy="cyclic", layers_per_step=1, backward="identity", log_every_n_steps=0)
    grads = BlockGrads()
    _trainer(tmp_path, plugin, max_steps=1, callbacks=[lcsb, grads], enable_checkpointing=False).fit(module)
    # block 0 is the one back-propagated: recomputed and decompressed once per Linear; the others never
    assert grads.backward_counts == [7, 0, 0, 0]
    assert grads.lora_grad == [True, False, False, False]
    assert plugin.last_metrics["mebp/decompress_bwd_count"] == 7 + 1  # and the LM head's input gradient
    assert plugin.last_metrics["mebp/decompress_fwd_count"] == 4 * 7 + 2
    after = _eval_logits(module)  # the model is usable after fit, in either install order
    assert torch.isfinite(after).all()
    if reference is not None:
        assert not torch.equal(after, reference)  # and it trained


def _eval_logits(module: LoraModule) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        out = module.model(tokens(batch=2, seq=16)).logits
    module.train()
    return out


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
        ({"fmt": "q4"}, ValueError, r"`fmt='q4'` is not supported; choose one of 'auto', 'int4', 'int4_asym', 'nf4', 'fp4'"),
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


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_converted_model_with_mmap_offload_copies_into_its_own_directory(tmp_path: Path, how: str) -> None:
    import copy
    import pickle

    from lcsb_lightning.mebp import apply_mebp

    model = add_lora(tiny_llama())
    apply_mebp(model, fmt="int4", group_size=32, offload="mmap", offload_dir=str(tmp_path))
    twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    ids = tokens()
    losses = []
    for m in (model, twin):
        m.train()
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    original, copied = mebp_state(model).offload, mebp_state(twin).offload
    assert copied.path != original.path and copied.bytes_written > 0
    copied.close()
    original.close()
    assert _files_under(tmp_path) == []
