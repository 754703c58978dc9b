"""LCSBCallback where Lightning users put it: configure_model, QuantizedMeBP in either order,
deep copies and pickles mid-fit, in-place ops, EMA, and the model after fit."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import WeightAveraging
from torch import nn
from torch.optim.swa_utils import get_ema_avg_fn

from lcsb_lightning import LCSBCallback
from lcsb_lightning.mebp import QuantizedMeBP
from tests.conftest import TokenLM, quiet_trainer, tiny_llama_peft, token_batches


class BuiltInConfigureModel(TokenLM):
    """Builds its LoRA model in ``configure_model``, as Lightning recommends for large models."""

    def __init__(self) -> None:
        super().__init__(model=nn.Identity(), lr=5e-3)
        self.model = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_llama_peft(num_layers=4)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))


def _logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(_tokens()).logits


def test_model_built_in_configure_model() -> None:
    module = BuiltInConfigureModel()
    lcsb = LCSBCallback("cyclic", layers_per_step=1, log_every_n_steps=0)
    quiet_trainer(max_steps=4, callbacks=[lcsb]).fit(module, token_batches(num_batches=4, seq=12, vocab=64))
    # cyclic k=1 with the truncated backward: the selected block and every block above it train
    assert lcsb.selection_counts == [1, 2, 3, 4]


@pytest.mark.parametrize("order", ["plugin_converts_first", "lcsb_installed_first"])
def test_lcsb_and_quantized_mebp_in_either_order_then_model_is_usable(order: str) -> None:
    torch.manual_seed(0)
    module = TokenLM(tiny_llama_peft(num_layers=4), lr=5e-3)
    plugin = QuantizedMeBP(fmt="int4", group_size=32, compress_embeddings=False)
    if order == "plugin_converts_first":  # what a validation before fit does
        plugin.convert_module(module)
    lcsb = LCSBCallback("cyclic", layers_per_step=2, log_every_n_steps=0)
    trainer = quiet_trainer(max_steps=4, callbacks=[lcsb], plugins=[plugin], precision=None)
    trainer.fit(module, token_batches(num_batches=4, seq=12, vocab=64))
    after_fit = _logits(module.model)  # raised AttributeError '_lcsb_skipped' before
    assert torch.isfinite(after_fit).all()
    module.model.train()
    second = quiet_trainer(max_steps=2, callbacks=[LCSBCallback("cyclic", layers_per_step=2, log_every_n_steps=0)],
                           plugins=[plugin], precision=None)
    second.fit(module, token_batches(num_batches=2, seq=12, vocab=64))  # a fresh fit on the same model works


def test_model_after_fit_computes_what_it_computed_with_lcsb_never_installed() -> None:
    torch.manual_seed(0)
    module = TokenLM(tiny_llama_peft(num_layers=4), lr=5e-3)
    twin = copy.deepcopy(module)
    lcsb = LCSBCallback("cyclic", layers_per_step=2, log_every_n_steps=0)
    quiet_trainer(max_steps=3, callbacks=[lcsb]).fit(module, token_batches(num_batches=3, seq=12, vocab=64))
    with torch.no_grad():  # give the twin the trained weights; it never had LCSB installed
        for p, q in zip(module.parameters(), twin.parameters()):
            q.copy_(p)
    assert all("forward" not in vars(m) for m in module.modules())
    assert torch.equal(_logits(module.model), _logits(twin.model))


class CopyMidFit(Callback):
    """Deep-copies and pickles the module while LCSB is installed (what EMA/SWA and torch.save do)."""

    def __init__(self) -> None:
        self.copy_out: torch.Tensor | None = None
        self.original_out: torch.Tensor | None = None
        self.pickled_out: torch.Tensor | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != 1:
            return
        twin = copy.deepcopy(pl_module.model)
        with torch.no_grad():
            for name, p in twin.named_parameters():
                if "lora_B" in name:
                    p.add_(1.0)  # the copy's own weights differ from the original's
        buffer = io.BytesIO()
        torch.save(pl_module.model, buffer)
        buffer.seek(0)
        restored = torch.load(buffer, weights_only=False)
        pickle.dumps(pl_module.model)
        tokens = _tokens()
        with torch.no_grad():
            self.copy_out = twin(tokens).logits
            self.original_out = pl_module.model(tokens).logits
            self.pickled_out = restored(tokens).logits


def test_deepcopy_and_pickle_while_installed() -> None:
    module = TokenLM(tiny_llama_peft(num_layers=4), lr=5e-3)
    probe = CopyMidFit()
    lcsb = LCSBCallback("cyclic", layers_per_step=1, log_every_n_steps=0)
    quiet_trainer(max_steps=3, callbacks=[lcsb, probe]).fit(module, token_batches(num_batches=3, seq=12, vocab=64))
    assert probe.copy_out is not None and probe.original_out is not None and probe.pickled_out is not None
    assert not torch.allclose(probe.copy_out, probe.original_out)  # the copy runs its own weights
    assert torch.equal(probe.pickled_out, probe.original_out)


class InPlaceLM(TokenLM):
    """A training step that modifies each block's output in place (as some models and hooks do)."""

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        base = self.model.get_base_model()
        h = base.model.embed_tokens(tokens)
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0)
        position_embeddings = base.model.rotary_emb(h, position_ids)
        for layer in base.model.layers:
            out = layer(h, position_embeddings=position_embeddings, position_ids=position_ids)
            h = out[0] if isinstance(out, tuple) else out
            h.mul_(1.0)
        return base.lm_head(base.model.norm(h))


def test_in_place_op_on_a_skipped_block_output() -> None:
    module = InPlaceLM(tiny_llama_peft(num_layers=4), lr=5e-3)
    lcsb = LCSBCallback("cyclic", layers_per_step=1, log_every_n_steps=0)
    quiet_trainer(max_steps=4, callbacks=[lcsb]).fit(module, token_batches(num_batches=4, seq=12, vocab=64))
    assert len(module.losses) == 4 and all(torch.isfinite(torch.tensor(module.losses)))


def test_ema_weight_averaging_next_to_lcsb() -> None:
    module = TokenLM(tiny_llama_peft(num_layers=4), lr=5e-3)
    ema = WeightAveraging(avg_fn=get_ema_avg_fn(0.9))
    lcsb = LCSBCallback("cyclic", layers_per_step=2, log_every_n_steps=0)
    quiet_trainer(max_steps=4, callbacks=[lcsb, ema]).fit(module, token_batches(num_batches=4, seq=12, vocab=64))
    averaged = ema._average_model.module  # type: ignore[union-attr]
    assert all("forward" not in vars(m) for m in averaged.modules())
    assert torch.isfinite(_logits(averaged.model)).all()


class FailingLM(TokenLM):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_model_restored_after_a_failed_fit() -> None:
    module = FailingLM(tiny_llama_peft(num_layers=4), lr=5e-3)
    lcsb = LCSBCallback("cyclic", layers_per_step=1, log_every_n_steps=0)
    with pytest.raises(RuntimeError, match="boom"):
        quiet_trainer(max_steps=4, callbacks=[lcsb]).fit(module, token_batches(num_batches=4, seq=12, vocab=64))
    assert all("forward" not in vars(m) for m in module.modules())
    assert torch.isfinite(_logits(module.model)).all()
