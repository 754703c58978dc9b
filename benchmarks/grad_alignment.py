"""How close is the identity-path gradient to the exact one? Per cyclic group, on real SmolLM2.

For one batch of real text, computes the exact LoRA gradient (full backprop), then for each cyclic
group the gradient LCSB's identity path gives that group, and prints their cosine similarity and
norm ratio. The top group's gradient is exact by construction (nothing above it is skipped); lower
groups see the skipped blocks' Jacobians replaced by the identity.

Run (about a minute on 2 cores, after the recipes' one-off SmolLM2 conversion)::

    python benchmarks/grad_alignment.py                 # real SmolLM2-135M, k = N/4
    python benchmarks/grad_alignment.py --fraction 0.5 --seq 128
"""

from __future__ import annotations

import argparse

import pydoc_data.topics
import torch
from peft import LoraConfig, get_peft_model

from lcsb_lightning.blocks import map_trainable_params
from lcsb_lightning.policies import CyclicPolicy
from lcsb_lightning.recipes.models import smollm2_135m
from lcsb_lightning.selective import SelectiveBackprop

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lora-b-std", type=float, default=1e-3,
                        help="std of LoRA B (0 at peft's init would leave A without gradient)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    bundle = smollm2_135m()
    model = get_peft_model(bundle.model, LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=args.lora_b_std)
    text = " ".join(list(pydoc_data.topics.topics.values())[:40])
    tokens = bundle.tokenizer(text, return_tensors="pt").input_ids[:, : args.seq]

    def lora_grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    exact = lora_grads()
    mapped = map_trainable_params(model)
    policy = CyclicPolicy(fraction=args.fraction)
    policy.setup(mapped.num_blocks)
    print(f"SmolLM2-135M, {mapped.num_blocks} blocks, seq {tokens.shape[1]}, LoRA r16, k = {policy.k}")
    print(f"{'group':<8}{'blocks':<10}{'cosine(identity, exact)':>26}{'norm ratio':>12}")
    for g, group in enumerate(policy.groups):
        for i, params in enumerate(mapped.params_per_block):
            for p in params:
                p.requires_grad_(i in group)
        selective = SelectiveBackprop(mapped.blocks)
        selective.set_selection(group)
        identity = lora_grads()
        selective.remove()
        names = [n for i in group for n in mapped.names_per_block[i]]
        a = torch.cat([identity[n].flatten() for n in names])
        e = torch.cat([exact[n].flatten() for n in names])
        cosine = torch.nn.functional.cosine_similarity(a, e, dim=0).item()
        print(f"{g:<8}{f'{group[0]}-{group[-1]}':<10}{cosine:>26.3f}{(a.norm() / e.norm()).item():>12.2f}")
        for p in mapped.all_block_params():
            p.requires_grad_(True)


if __name__ == "__main__":
    main()
