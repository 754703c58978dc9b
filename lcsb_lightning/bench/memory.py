"""Memory study, as MeBP's and MeSP's authors measure it: peak anonymous memory (``RssAnon``) inside the step.

Each configuration runs in a fresh process (:func:`measure`): a random-init shape built compressed (``qlora``:
bitsandbytes nf4 and HF gradient checkpointing), peft LoRA on the seven projections, batch 1, a ``Trainer`` with
``QuantizedMeBP``; a thread samples ``/proc/self/status`` every ``sample_ms``. The **breakdown** splits the training
peak by owner at block-boundary windows (:class:`StepWindows`, :class:`Census`, :func:`breakdown`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping

from lcsb_lightning.peft_without_bnb import peft_without_bitsandbytes
from lcsb_lightning.process_memory import RunMemory, read_status  # RssAnon and VmRSS in MB of 2**20 bytes

#: The anchors' LoRA targets (MeBP and MeSP: r8 on these seven projections).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_MB = 2**20
#: The spec's ``optimizer``: ``adamw`` (the default; two moments per LoRA weight) or ``sgd`` (MeSP's: no
#: momentum, no state).
OPTIMIZERS = ("adamw", "sgd")


def check_optimizer(value: Any, field: str = "optimizer") -> str:
    """``value`` if it is one of :data:`OPTIMIZERS`; otherwise a ``ValueError`` naming ``field``, the value and
    the allowed values."""
    if not isinstance(value, str) or value not in OPTIMIZERS:
        raise ValueError(f"{field} must be one of {list(OPTIMIZERS)}, got {value!r}")
    return value


def _storages(tensors: Iterator[Any]) -> dict[int, int]:
    out: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


class Census:
    """Live tensor bytes by owner, in MB (each storage counted once, under its first owner)."""

    def __init__(self, model: Any, optimizer_getter: Any) -> None:
        from lcsb_lightning.mebp import mebp_state

        self.model, self.optimizer_getter = model, optimizer_getter
        self.state = mebp_state(model)
        self.checkpoint_inputs: list[weakref.ref] = []

    def __call__(self) -> dict[str, float]:
        import torch

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        store = self.state.weight_store if self.state is not None else None
        frozen = [t for t in (*self.model.parameters(), *self.model.buffers()) if not t.requires_grad
                  and not (store is not None and store.owns(t))]
        optimizer = self.optimizer_getter()
        states = [v for s in (optimizer.state.values() if optimizer is not None else ()) for v in s.values()
                  if isinstance(v, torch.Tensor)]
        inputs = [t for ref in self.checkpoint_inputs if (t := ref()) is not None]
        workspace = self.state.workspace if self.state is not None else None
        owners = {"lora_weights": _storages(iter(trainable)), "lora_grads": _storages(p.grad for p in trainable),
                  "optimizer_state": _storages(iter(states)), "weights_anon": _storages(iter(frozen)),
                  "checkpoints": _storages(iter(inputs)),
                  "decompression_buffers": _storages(iter(getattr(workspace, "buffers", list)()))}
        seen: set[int] = set()
        out: dict[str, float] = {}
        for name, found in owners.items():
            out[name] = sum(size for ptr, size in found.items() if ptr not in seen) / _MB
            seen.update(found)
        return out


class StepWindows:
    """Cuts each training step into windows at block boundaries and records, per window, the anonymous
    memory at its start, the live tensors by owner there and the peak inside it."""

    def __init__(self, sampler: RunMemory, census: Census, blocks: list[Any], final_norm: Any) -> None:
        from lcsb_lightning.mebp._internal.stats import recomputing

        self.sampler, self.census, self.windows = sampler, census, []
        self._open: dict[str, Any] | None = None
        self.trim = False
        for index, block in enumerate(blocks):
            # the first layer a block runs, in its forward and in its recompute
            first = getattr(block, "input_layernorm", None) or next(iter(block.children()))

            def pre_hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any], index: int = index) -> None:
                import torch

                if not torch.is_grad_enabled():
                    return
                if recomputing():
                    self.open(f"backward block {index}")
                else:
                    census.checkpoint_inputs.append(weakref.ref((*args, *kwargs.values())[0]))
                    self.open(f"forward block {index}")

            first.register_forward_pre_hook(pre_hook, with_kwargs=True)
        final_norm.register_forward_hook(lambda *_: self.open("loss") if self._open is not None else None)

    def open(self, name: str) -> None:
        peak, now = self.sampler.mark()
        if self._open is not None:
            self._open["peak_anon"] = peak
            self.windows.append(self._open)
        if self.trim:  # the breakdown's step: no allocator slack carried into the window
            from lcsb_lightning.mebp._internal.heap import trim_heap

            trim_heap()
            _, now = self.sampler.mark()
        self._open = {"window": name, "start_anon": now, "owners": self.census()}

    def close(self) -> None:
        self.open("end")
        self._open = None
        self.census.checkpoint_inputs.clear()


def breakdown(windows: list[dict[str, Any]], baseline_anon: float, runtime: float, headline_peak: float) -> dict[str, Any]:
    """The owners of the training peak ``headline_peak`` (MB above ``baseline_anon``), from the windows of a
    step whose heap was trimmed at each window start: the live tensors by owner and the working set of
    the window holding that step's peak; ``runtime`` (the anonymous memory that is not a tensor after
    loading: Python objects, the libraries' state); allocator slack, the headline peak less that step's."""
    top = max(windows, key=lambda w: w["peak_anon"])
    trimmed_peak = top["peak_anon"] - baseline_anon
    owners = {**top["owners"], "runtime objects": runtime,
              f"working set ({top['window'].split(' block')[0]})": top["peak_anon"] - top["start_anon"]}
    unaccounted = trimmed_peak - sum(owners.values())
    owners["allocator slack"] = headline_peak - trimmed_peak
    return {"window": top["window"], "owners_mb": {k: round(v, 1) for k, v in owners.items()},
            "unaccounted_mb": round(unaccounted, 1), "accounted": round(1 - abs(unaccounted) / headline_peak, 3)}


def save_random_init(model_config: Mapping[str, Any], folder: Path) -> None:
    """Save the shape's random init as a safetensors folder, in a separate process (its memory is not measured)."""
    if (folder / "config.json").is_file():
        return
    code = ("import json,sys,torch; from hydra.utils import instantiate; from transformers import AutoModelForCausalLM;"
            "torch.manual_seed(0); cfg = instantiate(json.loads(sys.argv[1]));"
            "AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, json.dumps(dict(model_config)), str(folder)], check=True, timeout=3600)


def measure(spec: Mapping[str, Any], out_json: Path, timeout: float | None = None) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter (``python -m lcsb_lightning.bench.memory``); its figures.

    Raises:
        ValueError: the spec's ``optimizer`` is not one of :data:`OPTIMIZERS` (before anything is written or run).
    """
    check_optimizer(spec.get("optimizer", "adamw"))
    out_json.parent.mkdir(parents=True, exist_ok=True)
    spec_path = out_json.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(dict(spec)))
    cmd = [sys.executable, "-m", "lcsb_lightning.bench.memory", "--spec", str(spec_path), "--out", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"memory run failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    return json.loads(out_json.read_text())


def _load(spec: Mapping[str, Any]) -> tuple[Any, list[Any]]:
    import torch
    from peft import LoraConfig, get_peft_model

    if spec["arm"] == "qlora":
        from peft import prepare_model_for_kbit_training
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(spec["folder"], quantization_config=quant, device_map="cpu",
                                                     dtype=torch.float32)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
        plugins: list[Any] = []
    else:
        from hydra.utils import instantiate

        from lcsb_lightning.mebp import MeBPConfig, QuantizedMeBP, load_compressed

        config = MeBPConfig(**{"fmt": "int4", **dict(spec.get("options") or {})})
        model = load_compressed(instantiate(spec["model_config"]), config)
        plugins = [QuantizedMeBP(config)]
    rank = int(spec["rank"])
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    with peft_without_bitsandbytes():
        return get_peft_model(model, lora), plugins


def _run(spec: Mapping[str, Any]) -> dict[str, Any]:
    optimizer = check_optimizer(spec.get("optimizer", "adamw"))  # before any work
    import torch  # the imports the baseline is read after
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lcsb_lightning.blocks import find_blocks
    from lcsb_lightning.mebp import chunked_lm_loss

    import peft, transformers  # noqa: F401,E401  (imported before the baseline, as the training needs them)

    sampler = RunMemory(float(spec.get("sample_ms", 2)) / 1000)
    baseline = read_status()
    sampler.reset()
    torch.manual_seed(0)
    start = time.perf_counter()
    model, plugins = _load(spec)
    load_s = time.perf_counter() - start
    load_peak_anon, load_peak_rss = sampler.peak_anon, sampler.peak_rss
    seq, arm = int(spec["seq_len"]), spec["arm"]

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            if arm == "qlora":
                return self.model(input_ids=ids, labels=ids).loss
            causal_lm = self.model.get_base_model()
            hidden = getattr(causal_lm, causal_lm.base_model_prefix)(input_ids=ids).last_hidden_state
            return chunked_lm_loss(hidden, causal_lm.get_output_embeddings(), ids, chunk_size=seq)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            trainable = [p for p in self.parameters() if p.requires_grad]
            if optimizer == "sgd":  # MeSP's: no momentum, so no state
                return torch.optim.SGD(trainable, lr=1e-4)
            return torch.optim.AdamW(trainable, lr=1e-4)

    module = Module()
    blocks = find_blocks(model)
    base = model.get_base_model()
    census = Census(model, lambda: module.trainer.optimizers[0] if module._trainer is not None else None)
    windows = StepWindows(sampler, census, blocks, getattr(base, base.base_model_prefix).norm)
    runtime = read_status().get("RssAnon", 0.0) - baseline.get("RssAnon", 0.0) - sum(census().values())

    class Steps(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.heap_trims: list[float] = []  # release_heap's trims per step (QuantizedMeBP's count)
            self.last_windows: list[dict[str, Any]] = []  # of the last step: the breakdown's

        def on_train_batch_start(self, trainer: Trainer, *_: Any) -> None:
            if trainer.global_step == warmup + measured:  # the breakdown's own step, after the measured ones
                self.peaks = sampler.peak_anon, sampler.peak_rss
                sampler.reset()
                windows.trim = True
            windows.open("step start")
            self._t0 = time.perf_counter()

        def on_before_optimizer_step(self, *_: Any) -> None:
            windows.open("optimizer step")

        def on_train_batch_end(self, *_: Any) -> None:
            self.seconds.append(time.perf_counter() - self._t0)
            if plugins:
                self.heap_trims.append(plugins[0].last_metrics.get("mebp/heap_trims"))
            windows.close()
            self.last_windows = list(windows.windows)
            windows.windows.clear()

    steps = Steps()
    warmup, measured = int(spec["warmup"]), int(spec["steps"])
    ids = torch.randint(0, int(model.config.vocab_size), (warmup + measured + 1, seq), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=warmup + measured + 1, plugins=plugins, callbacks=[steps],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    sampler.reset()
    trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=1))
    sampler.close()
    peak_anon, peak_rss = steps.peaks
    anon0, rss0 = baseline.get("RssAnon", 0.0), baseline.get("VmRSS", 0.0)
    return {
        "arm": arm, "options": dict(spec.get("options") or {}), "optimizer": optimizer, "seq_len": seq,
        "peak_anon_train_mb": round(peak_anon - anon0, 1), "peak_anon_load_mb": round(load_peak_anon - anon0, 1),
        "peak_rss_above_import_mb": round(max(peak_rss, load_peak_rss) - rss0, 1),
        "peak_rss_mb": round(max(peak_rss, load_peak_rss), 1), "rss_after_import_mb": round(rss0, 1),
        "load_s": round(load_s, 2), "step_s": round(sum(steps.seconds[warmup:-1]) / max(1, measured), 3),
        "heap_trims_per_step": steps.heap_trims[:-1],
        "breakdown": breakdown(steps.last_windows, anon0, runtime, peak_anon - anon0),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One configuration of the memory study, in this fresh process.")
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    args.out.write_text(json.dumps(_run(json.loads(args.spec.read_text()))))
