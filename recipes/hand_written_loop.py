# python recipes/hand_written_loop.py [--steps 20]
"""Selective backprop without Lightning: ``LCSBController`` in a plain PyTorch training loop.

Two calls per step: ``begin_step(step)`` before the forward pass picks the blocks and
prepares the model; ``before_optimizer_step(optimizer)`` after ``backward()`` feeds the policy and
leaves the gradients AdamW should see. ``release()`` restores the model. Copy and edit.
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lcsb_lightning import LCSBController
from lcsb_lightning.policies import DyadicPolicy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules="all-linear")).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    controller = LCSBController(model, DyadicPolicy(levels=3), backward="selected_only")
    data = torch.randint(0, 256, (args.steps, 2, 64), generator=torch.Generator().manual_seed(0))
    try:
        for step, tokens in enumerate(data):
            controller.begin_step(step)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            controller.before_optimizer_step(optimizer)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            print(f"step {step:3d}  loss {loss.item():.4f}  blocks {controller.selection[0]}-{controller.selection[-1]}")
    finally:
        controller.release()


if __name__ == "__main__":
    main()
