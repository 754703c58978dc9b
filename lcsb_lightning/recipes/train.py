"""The fine-tuning run behind ``lcsb-finetune``: instantiate the composed config, train, write the outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from lcsb_lightning.recipes.outputs import atomic_write_json, peak_rss_mb, save_adapter
from lcsb_lightning.recipes.progress import LCSBProgressBar, StepTimer
from lcsb_lightning.recipes.batching import collate

log = logging.getLogger(__name__)

SUMMARY_NAME = "summary.json"
ADAPTER_NAME = "adapter"


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    return out


def _hydra_choices() -> dict[str, Any]:
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            hc = HydraConfig.get()
            return {"choices": dict(hc.runtime.choices), "overrides": list(hc.overrides.task)}
    except Exception:  # noqa: BLE001 - the summary is still useful without them
        pass
    return {}


def build(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that re-raises a configuration error (missing file, column, label,
    bad value) as itself rather than wrapped, so the message the user sees is the one that explains it."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, (FileNotFoundError, KeyError, ValueError, TypeError, ImportError)):
            raise cause from None
        raise


def build_plugins(cfg: DictConfig) -> list[Any]:
    """Instantiate the ``mebp`` group (``none`` gives no plugin)."""
    if cfg.get("mebp") is None or "_target_" not in cfg.mebp:
        return []
    return [build(cfg.mebp)]


def make_loaders(data: Any, cfg: DictConfig, pad_id: int) -> tuple[DataLoader, DataLoader]:
    """Training (seeded shuffle) and evaluation data loaders."""
    fn = partial(collate, pad_id=pad_id)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    train = DataLoader(data.train, batch_size=int(cfg.batch_size), shuffle=True, collate_fn=fn, generator=gen)
    evals = DataLoader(data.eval, batch_size=int(cfg.eval_batch_size), shuffle=False, collate_fn=fn)
    return train, evals


def run_finetune(cfg: DictConfig, output_dir: str | Path, extra_callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Fine-tune as configured and write TensorBoard logs, the adapter and ``summary.json`` into ``output_dir``.

    Order: the task is constructed first (its files, columns and labels are checked before any
    model is loaded), then the model (the sequence length is checked against its context), then
    training. The adapter and the summary are written last, each through a temporary path and a
    rename, so a failed run leaves neither behind.

    Args:
        cfg: The composed config (``conf/config.yaml``).
        output_dir: The run directory (Hydra's output directory).
        extra_callbacks: More Lightning callbacks for the Trainer (the benchmark's recorder).

    Returns:
        The summary that was written.
    """
    start = time.perf_counter()
    out = Path(output_dir)
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    if int(cfg.seq_len) < 2:
        raise ValueError(f"seq_len must be at least 2, got {cfg.seq_len}")

    task = build(cfg.task, _convert_="all")
    bundle = build(cfg.model)
    if int(cfg.seq_len) > bundle.max_positions:
        raise ValueError(
            f"seq_len={cfg.seq_len} is above the context length of {bundle.name} "
            f"(max_position_embeddings={bundle.max_positions}); use seq_len<={bundle.max_positions}"
        )
    data = task.build(bundle.tokenizer, int(cfg.seq_len))
    log.info("task %s: %d training and %d evaluation examples", type(task).__name__, len(data.train), len(data.eval))
    train_loader, eval_loader = make_loaders(data, cfg, bundle.tokenizer.pad_token_id)

    lora = build(cfg.lora, _convert_="all") if cfg.get("lora") and "_target_" in cfg.lora else None
    module = build(cfg.module, _convert_="all")(
        model=bundle.model, tokenizer=bundle.tokenizer, task=task, lora=lora
    )
    policy = build(cfg.policy) if cfg.get("policy") and "_target_" in cfg.policy else None
    callbacks: list[Any] = [cb for cb in (policy,) if cb is not None]
    timer = StepTimer()
    callbacks.append(timer)
    callbacks.extend(extra_callbacks)
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(LCSBProgressBar())
    logger = build(cfg.logger, save_dir=str(out))
    plugins = build_plugins(cfg)
    extra: dict[str, Any] = {"precision": None} if plugins else {}  # the MeBP plugin sets the precision
    trainer: L.Trainer = build(
        cfg.trainer, callbacks=callbacks, logger=logger, plugins=plugins, default_root_dir=str(out), **extra
    )

    initial: dict[str, float] = {}
    if cfg.get("eval_before_training", True):
        initial = _scalars(trainer.validate(module, eval_loader, verbose=False)[0])
    fit_start = time.perf_counter()
    trainer.fit(module, train_loader, eval_loader)
    fit_seconds = time.perf_counter() - fit_start
    final = _scalars(trainer.validate(module, eval_loader, verbose=False)[0])

    adapter_dir = save_adapter(module.model, out / ADAPTER_NAME)
    trainable = sum(p.numel() for n, p in module.model.named_parameters() if "lora_" in n)
    steps = int(trainer.global_step)
    train_seconds = timer.total_seconds or fit_seconds
    summary: dict[str, Any] = {
        "model": bundle.name,
        "task": type(task).__name__,
        "task_kind": task.kind,
        "policy": getattr(policy, "policy", None).__class__.__name__ if policy is not None else None,
        "initial_metrics": initial,
        "final_metrics": final,
        "steps": steps,
        "train_examples": len(data.train),
        "eval_examples": len(data.eval),
        "skipped_examples": data.skipped,
        "fit_seconds": round(fit_seconds, 3),
        "train_step_seconds": round(train_seconds, 3),
        "steps_per_second": round(steps / train_seconds, 4) if train_seconds > 0 else None,
        "wall_seconds": round(time.perf_counter() - start, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "lora_parameters": trainable,
        "num_blocks": len(getattr(policy, "selection_counts", []) or []),
        "block_selection_counts": list(getattr(policy, "selection_counts", []) or []),
        "adapter_dir": str(adapter_dir),
        "log_dir": str(getattr(logger, "log_dir", out)),
        **_hydra_choices(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    atomic_write_json(out / SUMMARY_NAME, summary)
    log.info(
        "eval loss %s -> %s in %d steps (%.2f steps/s), peak RSS %.0f MiB; outputs in %s",
        initial.get("val/loss"),
        final.get("val/loss"),
        steps,
        summary["steps_per_second"] or 0.0,
        summary["peak_rss_mb"],
        out,
    )
    return summary
