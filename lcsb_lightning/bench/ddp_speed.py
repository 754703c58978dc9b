"""DDP step time with LCSB: plain ``strategy="ddp"`` (every parameter gets a gradient, no graph
traversal) against ``ddp_find_unused_parameters_true`` and one process, on a Llama-shaped model.

Each configuration runs ``python -m lcsb_lightning.bench.ddp_speed --settings S --out DIR`` in a fresh
process; Lightning's launcher starts the other ranks. Processes share the machine's cores equally
(``torch`` threads = cores // processes), and the global batch is the same in every configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

import torch


def time_config(settings: Mapping[str, Any], folder: Path, timeout: float = 3600) -> dict[str, Any]:
    """Run one configuration in a fresh process and return its timing (``median_s``, ``tokens_per_s``, ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "settings.json"
    spec.write_text(json.dumps(dict(settings)))
    cmd = [sys.executable, "-m", "lcsb_lightning.bench.ddp_speed", "--settings", str(spec), "--out", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"ddp_speed run failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    return json.loads((folder / "timing.json").read_text())


def _main(settings: Mapping[str, Any], out: Path) -> None:
    from lightning.pytorch import Trainer
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from lcsb_lightning import LCSBCallback
    from lcsb_lightning.bench.recorder import CurveRecorder
    from lcsb_lightning.recipes.module import CausalLMModule

    processes = int(settings["processes"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
    torch.manual_seed(0)
    m = settings["model"]
    config = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
                         num_hidden_layers=m["num_hidden_layers"], num_attention_heads=m["num_attention_heads"],
                         num_key_value_heads=m["num_key_value_heads"], max_position_embeddings=4096, tie_word_embeddings=True)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))

    class Task:  # the module needs a task only for its evaluation kind
        kind = "lm"

    module = CausalLMModule(model, tokenizer=None, task=Task(), lr=1e-4, warmup_steps=0, schedule="constant")
    steps = int(settings["warmup"]) + int(settings["steps"])
    global_batch, seq = 4, int(settings["seq_len"])
    ids = torch.randint(0, m["vocab_size"], (steps * global_batch, seq), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(ids), batch_size=global_batch // processes,
                      collate_fn=lambda rows: {"input_ids": torch.stack([r[0] for r in rows]),
                                               "labels": torch.stack([r[0] for r in rows]),
                                               "attention_mask": torch.ones(len(rows), seq, dtype=torch.long)})
    recorder = CurveRecorder()
    lcsb = LCSBCallback("cyclic", fraction=float(settings["fraction"]), backward=settings["backward"], log_every_n_steps=0)
    trainer = Trainer(accelerator="cpu", devices=processes, strategy=settings["strategy"], max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[lcsb, recorder], limit_val_batches=0)
    trainer.fit(module, data)
    if trainer.is_global_zero:
        seconds = [b - a for a, b in zip([0.0, *recorder.seconds], recorder.seconds)][int(settings["warmup"]):]
        median = statistics.median(seconds)
        (out / "timing.json").write_text(json.dumps({
            "processes": processes, "strategy": settings["strategy"], "median_s": median, "step_seconds": seconds,
            "tokens_per_s": global_batch * seq / median, "threads_per_process": torch.get_num_threads(),
            "loadavg": os.getloadavg(),
        }))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One configuration of the DDP step-time study.")
    parser.add_argument("--settings", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    _main(json.loads(args.settings.read_text()), args.out)
