"""MeBP memory/speed benchmark: one process per configuration, whole-process peak RSS, steps/s.

Model: Qwen2.5-0.5B-shaped random init (24 layers, hidden 896, 14/2 heads, intermediate 4864,
vocab 151936, tied embeddings) saved once as a safetensors folder, LoRA r8 on all seven
projections, batch 1, float32 compute, AdamW, a Lightning Trainer in every configuration:

  (a) today's recipe: peft + BitsAndBytesConfig(load_in_4bit=True) nf4 + HF gradient checkpointing
  (b) load_compressed + QuantizedMeBP, full backprop
  (c) (b) + LCSBCallback(policy="cyclic", layers_per_step=N // 4, backward="identity")

Usage::

    python benchmarks/bench_mebp.py                    # full benchmark (about 10 min on 2 CPU cores)
    python benchmarks/bench_mebp.py --layers 4 --steps 1 --warmup 1   # quick smoke run
    python benchmarks/bench_mebp.py --configs a,b,c,b0                 # also (b) with default malloc

Every child process runs with ``MALLOC_ARENA_MAX=1 MALLOC_TRIM_THRESHOLD_=0`` (``--malloc lean``,
the default) except ``b0``; ``--malloc default`` leaves glibc's settings for all.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

CONFIGS = {
    "a": "peft + bnb nf4 + HF grad ckpt",
    "b": "QuantizedMeBP (full backprop)",
    "c": "QuantizedMeBP + LCSB cyclic k=N/4",
    "b0": "(b) with glibc's default malloc settings",
}
#: glibc settings every child runs with (unless --malloc default): one arena and trimming the heap
#: top on every free keep freed decompression buffers from staying resident.
LEAN_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": "0"}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qwen_config(layers: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=layers, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
        use_cache=False,
    )


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def current_rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def prepare(folder: str, layers: int) -> None:
    """Random-init the model in float32 and save it (a separate process: its memory is not measured)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen_config(layers), dtype=torch.float32)
    model.save_pretrained(folder)


def run(config: str, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    start = time.perf_counter()
    plugins: list[Any] = []
    callbacks: list[Any] = []
    if config == "a":
        from peft import prepare_model_for_kbit_training
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map="cpu", dtype=torch.float32)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:
        from lcsb_lightning.mebp import QuantizedMeBP, load_compressed

        model = load_compressed(folder, fmt=args.fmt, group_size=args.group_size, checkpoint=True)
        plugins.append(QuantizedMeBP(fmt=args.fmt, group_size=args.group_size))
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = get_peft_model(model, lora)
    load_s = time.perf_counter() - start
    rss_after_load = current_rss_mb()
    num_layers = model.config.num_hidden_layers
    driver = "-"
    if config == "c":
        from lcsb_lightning.callback import LCSBCallback

        callbacks.append(LCSBCallback(policy="cyclic", layers_per_step=num_layers // 4, backward="identity"))
        driver = f"LCSBCallback(cyclic, k={num_layers // 4})"

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            if config == "a":
                return self.model(input_ids=ids, labels=ids).loss
            from lcsb_lightning.mebp import chunked_lm_loss

            causal_lm = self.model.get_base_model()
            hidden = causal_lm.model(input_ids=ids).last_hidden_state
            return chunked_lm_loss(hidden, causal_lm.lm_head, ids, chunk_size=args.seq)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    class Timer(Callback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.metrics: list[dict[str, float]] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
            self.step_s.append(time.perf_counter() - self._start)
            metrics = getattr(trainer.precision_plugin, "last_metrics", None)
            if metrics:
                self.metrics.append(dict(metrics))

    timer = Timer()
    total = args.warmup + args.steps
    ids = torch.randint(0, 151936, (total, args.seq), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=total, plugins=plugins, callbacks=[timer, *callbacks],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(TensorDataset(ids), batch_size=1))
    measured = timer.step_s[args.warmup :]
    result: dict[str, Any] = {
        "config": config,
        "peak_rss_mb": peak_rss_mb(),
        "rss_after_load_mb": rss_after_load,
        "load_s": load_s,
        "step_s": sum(measured) / len(measured),
        "steps_per_s": len(measured) / sum(measured),
        "driver": driver,
        "layers": num_layers,
    }
    kept = timer.metrics[args.warmup :]
    if kept:
        for key in ("mebp/decompress_fwd_ms", "mebp/decompress_bwd_ms", "mebp/recompute_ms", "mebp/backward_ms"):
            result[key] = sum(m.get(key, 0.0) for m in kept) / len(kept)
        result["decompress_share_bwd"] = result["mebp/decompress_bwd_ms"] / result["mebp/backward_ms"]
    return result


def table(results: dict[str, dict[str, Any]]) -> str:
    base = results.get("a")
    full = results.get("b")
    head = f"| config | what | peak RSS (MB) | vs (a) | s/step | steps/s | vs (b) | decomp fwd ms | decomp bwd ms | backward ms | decomp share of bwd |"
    lines = [head, "|" + "---|" * 11]
    for key, res in results.items():
        rss_ratio = f"{res['peak_rss_mb'] / base['peak_rss_mb']:.2f}x" if base else "-"
        speed_ratio = f"{res['steps_per_s'] / full['steps_per_s']:.2f}x" if full else "-"
        fwd = f"{res['mebp/decompress_fwd_ms']:.0f}" if "mebp/decompress_fwd_ms" in res else "-"
        bwd = f"{res['mebp/decompress_bwd_ms']:.0f}" if "mebp/decompress_bwd_ms" in res else "-"
        back = f"{res['mebp/backward_ms']:.0f}" if "mebp/backward_ms" in res else "-"
        share = f"{100 * res['decompress_share_bwd']:.0f}%" if "decompress_share_bwd" in res else "-"
        lines.append(
            f"| ({key}) | {CONFIGS[key]} | {res['peak_rss_mb']:.0f} | {rss_ratio} | {res['step_s']:.2f} | "
            f"{res['steps_per_s']:.3f} | {speed_ratio} | {fwd} | {bwd} | {back} | {share} |"
        )
    return "\n".join(lines)


def goals(results: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    a, b, c = results.get("a"), results.get("b"), results.get("c")
    if b:
        ok = b["peak_rss_mb"] < 1024
        out.append(f"(b) peak RSS < 1 GB: {b['peak_rss_mb']:.0f} MB -> {'MET' if ok else 'MISSED'}")
    if a and b:
        ratio = b["peak_rss_mb"] / a["peak_rss_mb"]
        out.append(f"(b) peak RSS <= 0.6x (a): {ratio:.2f}x -> {'MET' if ratio <= 0.6 else 'MISSED'}")
    if b and c:
        ratio = c["steps_per_s"] / b["steps_per_s"]
        out.append(f"(c) >= 2x steps/s of (b): {ratio:.2f}x -> {'MET' if ratio >= 2 else 'MISSED'}")
    if b and "decompress_share_bwd" in b:
        out.append(
            f"(b) decompression share of backward: {100 * b['decompress_share_bwd']:.0f}% (paper: 32-42%)"
        )
    if c:
        out.append(f"(c) selection driven by {c['driver']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--fmt", default="nf4", choices=["int4", "nf4", "fp4"])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--configs", default="a,b,c")
    parser.add_argument("--malloc", default="lean", choices=["lean", "default"])
    parser.add_argument("--workdir", default=None, help="where the random-init checkpoint is saved (default: a temp dir)")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        prepare(args.workdir, args.layers)
        return
    if args.run is not None:
        print("RESULT " + json.dumps(run(args.run, args.workdir, args)), flush=True)
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_mebp_")
    folder = os.path.join(workdir, f"qwen05b_shape_{args.layers}l")
    common = ["--layers", str(args.layers), "--seq", str(args.seq), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--fmt", args.fmt, "--group-size", str(args.group_size)]
    try:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            print(f"saving the random-init checkpoint to {folder} ...", flush=True)
            subprocess.run([sys.executable, __file__, "--prepare", "--workdir", folder, *common], check=True)
        results: dict[str, dict[str, Any]] = {}
        for config in configs:
            print(f"running ({config}) {CONFIGS[config]} ...", flush=True)
            env = dict(os.environ)
            if args.malloc == "lean" and config != "b0":
                env.update(LEAN_MALLOC)
            proc = subprocess.run([sys.executable, __file__, "--run", "b" if config == "b0" else config,
                                   "--workdir", folder, *common], capture_output=True, text=True, env=env)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
                raise SystemExit(f"configuration ({config}) failed with exit code {proc.returncode}")
            results[config] = json.loads(lines[-1][len("RESULT "):])
            print(f"  {json.dumps(results[config])}", flush=True)
        print()
        print(f"Qwen2.5-0.5B-shaped random init, {args.layers} layers, seq {args.seq}, batch 1, float32, LoRA r8 x7, "
              f"AdamW, fmt={args.fmt}/{args.group_size}, {args.warmup} warm-up + {args.steps} measured steps, "
              f"{os.cpu_count()} CPU threads, malloc={args.malloc}, load average {os.getloadavg()[0]:.1f}")
        print(table(results))
        print()
        for line in goals(results):
            print(line)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
