"""Tiny seeded models shared by the tests: a plain torch residual stack and a peft-wrapped HF Llama."""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))


class ResidualNet(nn.Module):
    """Embedding -> N residual blocks -> head; only the blocks train (like LoRA-adapted blocks)."""

    def __init__(self, num_blocks: int = 4, width: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.stack = nn.ModuleList(ResidualBlock(width) for _ in range(num_blocks))
        self.head = nn.Linear(width, vocab)
        self.embed.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.stack:
            h = block(h)
        return self.head(h)


def tiny_llama_peft(num_layers: int = 4, seed: int = 0) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules="all-linear")
    peft_model = get_peft_model(model, lora)
    for name, p in peft_model.named_parameters():  # non-zero B so every LoRA parameter gets a gradient
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    return peft_model


def token_batches(num_batches: int = 8, batch: int = 2, seq: int = 12, vocab: int = 16, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (num_batches * batch, seq), generator=g)
    return DataLoader(TensorDataset(tokens), batch_size=batch, shuffle=False)


class TokenLM(LightningModule):
    """Next-token loss over a model mapping tokens to logits (plain or HF); records its losses."""

    def __init__(self, model: nn.Module, lr: float = 1e-2, weight_decay: float = 0.01,
                 optimizer_from_requires_grad: bool = True) -> None:
        super().__init__()
        self.model = model
        self.lr, self.weight_decay = lr, weight_decay
        self.optimizer_from_requires_grad = optimizer_from_requires_grad
        self.losses: list[float] = []

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(tokens)
        return out if isinstance(out, torch.Tensor) else out.logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self._logits(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad] if self.optimizer_from_requires_grad else []
        return torch.optim.AdamW(params or [nn.Parameter(torch.zeros(1))], lr=self.lr, weight_decay=self.weight_decay)



class FaultyLM(TokenLM):
    """A tiny peft Llama whose loss goes wrong at optimizer step ``at_step`` (on ``rank`` only, if given):
    ``"nan"`` (a NaN loss and gradient), ``"nan_value"`` (a NaN loss value with a finite gradient) or
    ``"spike"`` (the loss times 100)."""

    FAULTS = ("nan", "nan_value", "spike")

    def __init__(self, fault: str, at_step: int, rank: int | None = None) -> None:
        assert fault in self.FAULTS, fault
        super().__init__(tiny_llama_peft(num_layers=4), lr=5e-3)
        self.fault, self.at_step, self.rank = fault, at_step, rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step != self.at_step or self.rank not in (None, self.trainer.global_rank):
            return loss
        if self.fault == "nan":
            return loss * math.nan
        if self.fault == "nan_value":
            return loss + loss.detach() * math.nan
        return loss * 100.0

@pytest.fixture
def residual_net() -> Callable[..., ResidualNet]:
    def make(num_blocks: int = 4, seed: int = 0) -> ResidualNet:
        torch.manual_seed(seed)
        return ResidualNet(num_blocks)

    return make


def quiet_trainer(**kwargs: Any) -> "Any":
    from lightning.pytorch import Trainer

    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


@pytest.fixture(scope="session")
def smollm2_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Q4_K_M copy of SmolLM2-135M-Instruct made by llama.cpp's quantizer (tests/_gguf_utils.py)."""
    from _gguf_utils import llama_quantize, smollm2_q4_1

    return llama_quantize(smollm2_q4_1(), tmp_path_factory.mktemp("gguf") / "smollm2.Q4_K_M.gguf", "MOSTLY_Q4_K_M")


@pytest.fixture(scope="session")
def smollm2_f32(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An F32 copy of SmolLM2-135M-Instruct (its Q4_1 weights dequantized) made by llama.cpp (tests/_gguf_utils.py)."""
    from _gguf_utils import llama_quantize, smollm2_q4_1

    return llama_quantize(smollm2_q4_1(), tmp_path_factory.mktemp("gguf") / "smollm2.F32.gguf", "ALL_F32")
