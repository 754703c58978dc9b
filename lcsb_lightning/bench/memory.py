"""Memory study: whole-process peak RSS of one fine-tuning configuration per fresh process.

Arms (per random-init shape, LoRA on every block Linear, batch 1, float32 compute, a Lightning Trainer):

=============== ================================================================================
``qlora``       peft + ``BitsAndBytesConfig(load_in_4bit)`` nf4 + HF gradient checkpointing (the usual recipe)
``mebp``        ``load_compressed`` + ``QuantizedMeBP``, full backprop, chunked LM-head loss
``mebp_lcsb``   the same + ``LCSBCallback`` (``fraction`` of the blocks per step, the study's backward mode)
``mebp_lean``   ``mebp`` with its lower-memory options: ``weights="mmap"``, ``keep_recomputed_weights=False``
                (the same gradients)
``mebp_no_trim`` ``mebp`` with ``release_heap=False`` (glibc keeps the freed heap pages resident)
=============== ================================================================================

Each arm reports the whole-process peak RSS, the RSS right after importing the stack (so that
``peak - import`` is what the model and training cost), the RSS after loading, the step time and
QuantizedMeBP's decompression timings. ``malloc: default`` leaves glibc's allocator settings as a user
has them; ``lean`` runs with ``MALLOC_ARENA_MAX=1 MALLOC_TRIM_THRESHOLD_=0``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

ARMS = ("qlora", "mebp", "mebp_lcsb", "mebp_lean", "mebp_no_trim")
#: QuantizedMeBP options of the arms that change them.
ARM_OPTIONS: dict[str, dict[str, Any]] = {
    "mebp_lean": {"weights": "mmap", "keep_recomputed_weights": False},
    "mebp_no_trim": {"release_heap": False},
}
LEAN_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": "0"}


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def save_random_init(model_config: Mapping[str, Any], folder: Path) -> None:
    """Save the shape's random init as a safetensors folder, in a separate process (its memory is not measured)."""
    if (folder / "config.json").is_file():
        return
    code = ("import json,sys,torch; from hydra.utils import instantiate; from transformers import AutoModelForCausalLM;"
            "torch.manual_seed(0); cfg = instantiate(json.loads(sys.argv[1]));"
            "AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, json.dumps(dict(model_config)), str(folder)], check=True, timeout=3600)


def measure(spec: Mapping[str, Any], out_json: Path, timeout: float | None = None) -> dict[str, Any]:
    """Run one arm in a fresh interpreter (``python -m lcsb_lightning.bench.memory``) and return its figures."""
    out_json.parent.mkdir(parents=True, exist_ok=True)
    spec_path = out_json.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(dict(spec)))
    env = dict(os.environ)
    if spec.get("malloc", "default") == "lean":
        env.update(LEAN_MALLOC)
    cmd = [sys.executable, "-m", "lcsb_lightning.bench.memory", "--spec", str(spec_path), "--out", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory run failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    return json.loads(out_json.read_text())


def _run(spec: Mapping[str, Any]) -> dict[str, Any]:
    import torch  # the import the RSS baseline is read after
    from lightning.pytorch import Callback, LightningModule, Trainer
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader, TensorDataset

    from lcsb_lightning.recipes.outputs import peak_rss_mb

    rss_after_import = _rss_mb()
    torch.manual_seed(0)
    arm, folder, seq = spec["arm"], spec["folder"], int(spec["seq_len"])
    plugins: list[Any] = []
    callbacks: list[Any] = []
    start = time.perf_counter()
    if arm == "qlora":
        from peft import prepare_model_for_kbit_training
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map="cpu", dtype=torch.float32)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:
        from lcsb_lightning.mebp import MeBPConfig, QuantizedMeBP, load_compressed

        from hydra.utils import instantiate

        # Without a saved folder the random init is built from the shape's config, one tensor at a time.
        source = folder if folder is not None else instantiate(spec["model_config"])
        config = MeBPConfig(fmt=spec["fmt"], group_size=int(spec["group_size"]), **ARM_OPTIONS.get(arm, {}))
        model = load_compressed(source, config)
        plugins.append(QuantizedMeBP(config))
    rank = int(spec["rank"])
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear"))
    load_s = time.perf_counter() - start
    rss_after_load = _rss_mb()
    if arm == "mebp_lcsb":
        from lcsb_lightning import LCSBCallback

        callbacks.append(LCSBCallback("cyclic", fraction=float(spec["fraction"]), backward=spec["backward"], log_every_n_steps=0))

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            if arm == "qlora":
                return self.model(input_ids=ids, labels=ids).loss
            from lcsb_lightning.mebp import chunked_lm_loss

            causal_lm = self.model.get_base_model()
            hidden = getattr(causal_lm, causal_lm.base_model_prefix)(input_ids=ids).last_hidden_state
            return chunked_lm_loss(hidden, causal_lm.get_output_embeddings(), ids, chunk_size=seq)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    class Steps(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.metrics: list[dict[str, float]] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
            self.seconds.append(time.perf_counter() - self._t0)
            metrics = getattr(trainer.precision_plugin, "last_metrics", None)
            if metrics:
                self.metrics.append(dict(metrics))

    timer = Steps()
    warmup, steps = int(spec["warmup"]), int(spec["steps"])
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (warmup + steps, seq), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=warmup + steps, plugins=plugins, callbacks=[timer, *callbacks],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), DataLoader(TensorDataset(ids), batch_size=1))
    measured = timer.seconds[warmup:]
    peak = peak_rss_mb()
    result: dict[str, Any] = {
        "arm": arm, "peak_rss_mb": round(peak, 1), "rss_after_import_mb": round(rss_after_import, 1),
        "model_and_training_mb": round(peak - rss_after_import, 1), "rss_after_load_mb": round(rss_after_load, 1),
        "load_s": round(load_s, 2), "step_s": sum(measured) / len(measured), "malloc": spec.get("malloc", "default"),
    }
    kept = timer.metrics[warmup:]
    for key in ("mebp/decompress_fwd_ms", "mebp/decompress_bwd_ms", "mebp/recompute_ms", "mebp/backward_ms"):
        if kept and key in kept[0]:
            result[key] = sum(m.get(key, 0.0) for m in kept) / len(kept)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One arm of the memory study, in this fresh process.")
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    args.out.write_text(json.dumps(_run(json.loads(args.spec.read_text()))))
