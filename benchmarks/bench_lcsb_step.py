"""Step time of full backprop vs identity-path LCSB, alternating in one process.

SmolLM2-135M-shaped float32 Llama (30 layers, hidden 576, 9 heads / 3 KV heads, intermediate 1536,
vocab 49152, tied embeddings), random init, LoRA r16 on all seven projections, AdamW, batch 1.
Both arms go through the same LCSBController (full backprop = ``FullPolicy``), on two identical
model copies, one step each in turn, so drifts of the machine hit both arms alike.

The Amdahl bound comes from the same run's forward-only time ``T_fwd`` (forward with autograd
recording, as in training):  ``bound = T_full / (T_fwd + (T_full - T_fwd) * k / N)``.

Run::

    python benchmarks/bench_lcsb_step.py            # ~2 min on 2 cores
    python benchmarks/bench_lcsb_step.py --layers 4 --steps 2   # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
from torch import nn

from lcsb_lightning.controller import LCSBController
from lcsb_lightning.policies import CyclicPolicy, FullPolicy


def smollm2_shaped_lora(num_layers: int, rank: int, seed: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).float()
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, lora)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--fraction", type=float, default=0.25, help="k = round(fraction * N)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per arm (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=str, default=None, help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    arms: dict[str, tuple[nn.Module, LCSBController, torch.optim.Optimizer]] = {}
    for name, policy in (("full", FullPolicy()), ("lcsb", CyclicPolicy(fraction=args.fraction))):
        model = smollm2_shaped_lora(args.layers, args.rank, seed=0)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
        arms[name] = (model, LCSBController(model, policy, backward="identity", momentum="implicit"), optimizer)
    tokens = torch.randint(0, 49152, (1, args.seq), generator=torch.Generator().manual_seed(0))
    step_index = {"full": 0, "lcsb": 0}

    def train_step(name: str) -> None:
        model, controller, optimizer = arms[name]
        controller.begin_step(step_index[name], [optimizer])
        step_index[name] += 1
        lm_loss(model, tokens).backward()
        controller.before_optimizer_step(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def forward_only() -> None:
        model, controller, _ = arms["full"]
        controller.begin_step(step_index["full"], [])
        lm_loss(model, tokens)  # autograd records the graph, as in training; it is then dropped

    times: dict[str, list[float]] = {"full": [], "lcsb": [], "forward": []}
    for name in ("full", "lcsb"):
        train_step(name)  # warm-up
    forward_only()
    for _ in range(args.steps):
        for name in ("full", "lcsb"):
            times[name].append(timed(lambda n=name: train_step(n)))
        times["forward"].append(timed(forward_only))

    t_full, t_lcsb, t_fwd = (statistics.median(times[n]) for n in ("full", "lcsb", "forward"))
    lcsb_controller = arms["lcsb"][1]
    n_blocks = lcsb_controller.num_blocks
    k_mean = sum(lcsb_controller.selection_counts) / max(step_index["lcsb"], 1)
    bound = t_full / (t_fwd + (t_full - t_fwd) * k_mean / n_blocks)
    speedup = t_full / t_lcsb
    print(f"SmolLM2-135M shape, {n_blocks} layers, seq {args.seq}, LoRA r{args.rank}, fp32, "
          f"{args.threads} threads, {args.steps} timed steps per arm (medians)")
    print(f"{'arm':<34}{'step time (s)':>14}{'speed-up':>10}")
    print(f"{'full backprop':<34}{t_full:>14.3f}{1.0:>10.2f}")
    print(f"{f'LCSB identity, k={lcsb_controller.policy.k} of {n_blocks}':<34}{t_lcsb:>14.3f}{speedup:>10.2f}")
    print(f"{'forward only (T_fwd)':<34}{t_fwd:>14.3f}")
    print(f"Amdahl bound at mean k/N = {k_mean:.2f}/{n_blocks}: {bound:.2f}x; "
          f"LCSB reaches {100 * speedup / bound:.0f}% of it (goal: >= 1.6x and within 10% of the bound)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"t_full": t_full, "t_lcsb": t_lcsb, "t_fwd": t_fwd, "speedup": speedup, "bound": bound,
                       "k_mean": k_mean, "num_blocks": n_blocks, "times": times, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
