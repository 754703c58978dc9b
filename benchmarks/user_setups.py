"""Step time of full backprop and of ``LCSBCallback()`` in the set-ups users fine-tune with, side by side.

A user's LightningModule around a Llama shape (random init: speed only) trains with plain
``Trainer.fit``, once without LCSB (full backprop) and once with ``LCSBCallback()`` (the defaults),
in each set-up: plain peft LoRA, LoRA after ``enable_input_require_grads()``, LoRA plus a trainable
input embedding, LoRA with Hugging Face activation checkpointing (non-reentrant and reentrant), and
full fine-tuning without LoRA. Arms alternate within each round, in one process; each arm's figure is
the mean step time over one dyadic cycle (8 optimizer steps) after ``--warmup`` steps::

    python benchmarks/user_setups.py --rounds 2
    python benchmarks/user_setups.py --rounds 3 --lcsb-kwargs '{"unreached": "implicit"}'

It prints one line per measurement, then a markdown table with the speed-ups and the load average.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "seq_len": 16, "batch_size": 2},
    "llama16": {"vocab_size": 32000, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 16,
                "num_attention_heads": 6, "num_key_value_heads": 2, "seq_len": 128, "batch_size": 2},
}
CYCLE = 8  # the default dyadic policy's cycle: depths N/8, N/4, N/8, N/2, N/8, N/4, N/8, N


def _lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))


def _input_grads(model: nn.Module) -> nn.Module:
    model = _lora(model)
    model.enable_input_require_grads()
    return model


def _trainable_embedding(model: nn.Module) -> nn.Module:
    model = _lora(model)
    model.get_input_embeddings().weight.requires_grad_(True)
    return model


def _checkpointing(reentrant: bool) -> Callable[[nn.Module], nn.Module]:
    def make(model: nn.Module) -> nn.Module:
        model.activation_checkpointing_enable({"use_reentrant": reentrant})  # also enables input grads
        return _lora(model)

    return make


SETUPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "LoRA": _lora,
    "LoRA + enable_input_require_grads": _input_grads,
    "LoRA + trainable embedding": _trainable_embedding,
    "LoRA + HF checkpointing (non-reentrant)": _checkpointing(False),
    "LoRA + HF checkpointing (reentrant)": _checkpointing(True),
    "full fine-tuning": lambda model: model,
}


def _module(model: nn.Module) -> Any:
    from lightning.pytorch import LightningModule

    class UserLM(LightningModule):  # what a user writes
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            return self.model(input_ids=tokens, labels=tokens).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    return UserLM()


def _step_seconds(setup: str, lcsb: bool, shape: dict[str, int], warmup: int,
                  lcsb_kwargs: dict[str, Any] | None = None) -> float:
    """Mean seconds per optimizer step over one dyadic cycle after ``warmup`` steps."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from lcsb_lightning import LCSBCallback

    config = {k: v for k, v in shape.items() if k not in ("seq_len", "batch_size")}
    torch.manual_seed(0)
    model = SETUPS[setup](LlamaForCausalLM(LlamaConfig(**config, max_position_embeddings=shape["seq_len"])))
    steps = warmup + CYCLE
    tokens = torch.randint(0, shape["vocab_size"], (steps * shape["batch_size"], shape["seq_len"]))

    class Timer(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.seconds.append(time.perf_counter() - self.start)

    timer = Timer()
    callbacks = [timer, LCSBCallback(**(lcsb_kwargs or {}))] if lcsb else [timer]
    trainer = Trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_module(model), DataLoader(TensorDataset(tokens), batch_size=shape["batch_size"]))
    # the dyadic cycle starts at the global step warmup; its 8 steps visit every depth once
    return statistics.fmean(timer.seconds[warmup:])


def run(setups: list[str], shape_name: str, rounds: int, warmup: int,
        lcsb_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    seconds: dict[str, dict[str, list[float]]] = {s: {"full": [], "lcsb": []} for s in setups}
    loads = [os.getloadavg()[0]]
    for round_index in range(rounds):
        for setup in setups:
            for arm in ("full", "lcsb"):
                value = _step_seconds(setup, arm == "lcsb", shape, warmup, lcsb_kwargs)
                seconds[setup][arm].append(value)
                print(f"round {round_index}  {setup:42s} {arm:5s} {value:.3f} s/step  load {os.getloadavg()[0]:.2f}",
                      flush=True)
        loads.append(os.getloadavg()[0])
    return {"shape": shape_name, "rounds": rounds, "warmup": warmup, "lcsb_kwargs": lcsb_kwargs or {},
            "seconds": seconds, "load_average": loads}


def table(result: dict[str, Any]) -> str:
    call = ", ".join(f"{k}={v!r}" for k, v in result.get("lcsb_kwargs", {}).items())
    lines = [f"| set-up | full backprop s/step | `LCSBCallback({call})` s/step | speed-up per round | speed-up (mean) |",
             "|---|---|---|---|---|"]
    for setup, arms in result["seconds"].items():
        ratios = [f / s for f, s in zip(arms["full"], arms["lcsb"])]
        lines.append(
            f"| {setup} | {' / '.join(f'{v:.3f}' for v in arms['full'])} | {' / '.join(f'{v:.3f}' for v in arms['lcsb'])} "
            f"| {' / '.join(f'{r:.2f}x' for r in ratios)} | **{statistics.fmean(ratios):.2f}x** |"
        )
    loads = result["load_average"]
    lines.append(f"\nshape {result['shape']}, {result['rounds']} rounds, load average {min(loads):.2f}-{max(loads):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama16")
    parser.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=list(SETUPS), metavar="SETUP")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lcsb-kwargs", type=json.loads, default={}, metavar="JSON",
                        help='keyword arguments of LCSBCallback, e.g. \'{"unreached": "implicit"}\' (default: none)')
    parser.add_argument("--out", type=Path, default=None, help="write results.json and results.md into this folder")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error(f"--rounds must be >= 1 and --warmup >= 0, got {args.rounds} and {args.warmup}")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for name in ("lightning.pytorch", "lightning.fabric", "lcsb_lightning"):  # one line per measurement
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(does not have many workers|is deprecated).*")
    if not isinstance(args.lcsb_kwargs, dict):
        parser.error(f"--lcsb-kwargs must be a JSON object, got {args.lcsb_kwargs!r}")
    result = run(args.setups, args.shape, args.rounds, args.warmup, args.lcsb_kwargs)
    text = table(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=2))
        (args.out / "results.md").write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
