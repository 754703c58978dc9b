"""Tiny seeded models for the MeBP tests."""

from __future__ import annotations

import torch
from torch import nn



def tiny_config(num_layers: int = 4, tie: bool = True, vocab: int = 96):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie, use_cache=False,
    )


def tiny_llama(num_layers: int = 4, tie: bool = True, seed: int = 0) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(num_layers, tie)).float()


def add_lora(model: nn.Module, seed: int = 1) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, param in peft_model.named_parameters():  # non-zero B so that every LoRA weight gets a gradient
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)
    return peft_model


def lora_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def tokens(batch: int = 2, seq: int = 16, vocab: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
