"""The fine-tuning run behind ``lcsb-finetune``: :func:`prepare` builds the task, the model and the
``CausalLMModule``, :func:`build_trainer` the Trainer, and :func:`run_finetune` runs them and writes the run folder."""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from lcsb_lightning.export import check_gguf_lora, save_merged_gguf
from lcsb_lightning.guard import DivergenceGuard
from lcsb_lightning.heap_trim import HeapTrim
from lcsb_lightning.process_memory import RunMemory
from lcsb_lightning.mebp.convert import stored_formats
from lcsb_lightning.recompute import recompute_lower_blocks
from lcsb_lightning.recipes.batching import PaddingCollator
from lcsb_lightning.recipes.best_adapter import BestAdapter, save_adapters
from lcsb_lightning.recipes.checkpointing import (
    CHECKPOINT_DIR, LAST, AtomicCheckpointIO, EpochShuffle, Preempted, PreemptionCheckpoint, ResumableLoader, check_checkpoint,
    resolve_checkpoint,
)
from lcsb_lightning.recipes.config import check_config
from lcsb_lightning.recipes.models import ModelBundle, SameWeightsOnEveryRank
from lcsb_lightning.recipes.module import CausalLMModule
from lcsb_lightning.atomic_files import atomic_write_json, atomic_write_text
from lcsb_lightning.recipes.outputs import write_loss_curve
from lcsb_lightning.recipes.progress import LCSBProgressBar, StepTimer, final_table
from lcsb_lightning.recipes.tasks import Task, TaskData

log = logging.getLogger(__name__)
C = TypeVar("C")

SUMMARY_NAME = "summary.json"
INITIAL_NAME = "initial_metrics.json"
#: The resolved config a run saves when it starts: what ``resume=`` continues with.
RUN_CONFIG_NAME = "run_config.yaml"
ADAPTER_NAME = "adapter"
BEST_ADAPTER_NAME = "adapter_best"
LOSS_CURVE_NAME = "loss_curve.png"
MERGED_NAME = "merged.gguf"


def build(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that re-raises a configuration error (missing file, column, label,
    bad value) as itself rather than wrapped, so the message the user sees is the one that explains it."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, (FileNotFoundError, KeyError, ValueError, TypeError, ImportError, ConnectionError)):
            raise cause from None
        raise


@dataclass
class Prepared:
    """What :func:`prepare` built; ``gguf_base``: the GGUF file the base model was read from (GGUF adapters out)."""

    task: Task
    bundle: ModelBundle
    data: TaskData
    module: CausalLMModule
    gguf_base: str | None = None


def prepare(cfg: DictConfig) -> Prepared:
    """Build the task (its files, columns and labels checked first), the model (the sequence length
    checked against its context), the tokenized data and the ``CausalLMModule`` with its LoRA."""
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    task = build(cfg.task, _convert_="all")
    bundle = build(cfg.model, **model_loading_options(cfg))
    if int(cfg.seq_len) > bundle.max_positions:
        raise ValueError(
            f"seq_len={cfg.seq_len} is above the context length of {bundle.name} "
            f"(max_position_embeddings={bundle.max_positions}); use seq_len<={bundle.max_positions}"
        )
    data = task.build(bundle.tokenizer, int(cfg.seq_len))
    log.info("task %s: %d training and %d evaluation examples", type(task).__name__, len(data.train), len(data.eval))
    lora = build_group(cfg, "lora", _convert_="all")
    module = build(cfg.module, _convert_="all")(model=bundle.model, tokenizer=bundle.tokenizer, task=task, lora=lora)
    gguf_base = bundle.weights_file if bundle.weights_file and bundle.weights_file.endswith(".gguf") else None
    if gguf_base is not None:
        check_gguf_lora(module.model, gguf_base)  # an adapter llama.cpp could not apply is refused before training
    elif _merges(cfg):
        raise ValueError(f"export.merged=true merges into the base model's GGUF file, and {bundle.name} was not read "
                         "from one: allowed: a model read from a GGUF (model.source=gguf, model.gguf_file=...), or false")
    if not _configured(cfg, "mebp"):  # QuantizedMeBP wraps a compressed model's blocks itself
        recompute_lower_blocks(module.model, keep_top=cfg.get("keep_activations"))
    return Prepared(task, bundle, data, module, gguf_base)


def _merges(cfg: DictConfig) -> bool:
    """Whether the run writes ``merged.gguf`` (a config saved before 0.10 has no ``export`` node)."""
    return bool(OmegaConf.select(cfg, "export.merged", default=False))


def _configured(cfg: DictConfig, key: str) -> bool:
    """Whether the option of group ``key`` builds something (``mebp=none`` does not)."""
    node = cfg.get(key)
    return node is not None and "_target_" in node


def model_loading_options(cfg: DictConfig) -> dict[str, Any]:
    """``{"mebp": MeBPConfig}`` where the run compresses its model and the model node takes ``mebp`` (``smollm2_135m``
    and ``hf``: built compressed from the file, no float model); else ``{}`` (the plugin compresses at fit start)."""
    if not _configured(cfg, "mebp") or "mebp" not in cfg.model:
        return {}
    from lcsb_lightning.mebp import MeBPConfig

    return {"mebp": MeBPConfig.from_node(OmegaConf.to_container(cfg.mebp, resolve=True))}


def make_loaders(data: TaskData, cfg: DictConfig, tokenizer: Any) -> tuple[ResumableLoader, DataLoader]:
    """The training (seeded per epoch, resumable mid-epoch, sharded under DDP) and evaluation data loaders."""
    fn = PaddingCollator(tokenizer)
    sampler = EpochShuffle(len(data.train), seed=int(cfg.seed))
    train = ResumableLoader(data.train, batch_size=int(cfg.batch_size), sampler=sampler, collate_fn=fn)
    evals = DataLoader(data.eval, batch_size=int(cfg.eval_batch_size), shuffle=False, collate_fn=fn)
    return train, evals


def _batch_size(batch: Any) -> int:
    return int(batch["input_ids"].shape[0])


def _tokens(batch: Any) -> int:
    return int(batch["attention_mask"].sum())


def build_group(cfg: DictConfig, key: str, **kwargs: Any) -> Any:
    """The instantiated config group ``key`` (with ``kwargs``), or None where the option has no ``_target_`` (``none``)."""
    return build(cfg[key], **kwargs) if _configured(cfg, key) else None


def mebp_precision(cfg: DictConfig) -> str | None:
    """The ``trainer.precision`` the QuantizedMeBP plugin takes over (None without ``mebp``), in Lightning's
    full spelling (``32`` -> ``32-true``, ``bf16`` -> ``bf16-mixed``).

    Raises:
        ValueError: a precision the plugin does not run with.
    """
    if not _configured(cfg, "mebp"):
        return None
    from lcsb_lightning.mebp.plugin import PRECISIONS

    value = str(cfg.trainer.get("precision", "32-true"))
    precision = {"32": "32-true", "bf16": "bf16-mixed"}.get(value, value)
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={value!r} with mebp (QuantizedMeBP) is not supported; allowed: "
                         f"{', '.join(PRECISIONS)}")
    return precision


def build_trainer(cfg: DictConfig, output_dir: str | Path, extra_callbacks: Sequence[Any] = (),
                  gguf_base: str | None = None) -> tuple[L.Trainer, Any]:
    """The Trainer of the run and its LCSB callback (None without a policy): the callbacks, logger and plugins
    the config names, the ``extra_callbacks``, and the divergence guard last (it sees the gradients LCSB leaves).
    With ``gguf_base`` (the base model's GGUF file) the best adapter is also written as a GGUF adapter.

    Returns:
        ``(trainer, lcsb_callback_or_None)``.
    """
    mebp = build_group(cfg, "mebp", precision=mebp_precision(cfg))
    policy = build_group(cfg, "policy")
    lcsb = build_group(cfg, "lcsb", policy=policy) if policy is not None else None
    callbacks: list[Any] = [cb for cb in (lcsb, build_group(cfg, "freeze")) if cb is not None]
    callbacks += [SameWeightsOnEveryRank(), StepTimer(), HeapTrim(),
                  ThroughputMonitor(batch_size_fn=_batch_size, length_fn=_tokens), *extra_callbacks]
    if cfg.get("best_adapter") is not None:
        best = BestAdapter(Path(output_dir) / BEST_ADAPTER_NAME, str(cfg.best_adapter),
                           str(cfg.get("best_adapter_mode", "min")), gguf_base)
        callbacks.append(best)
        if cfg.get("early_stopping_patience") is not None:  # watches what the best adapter is chosen by
            callbacks.append(EarlyStopping(monitor=best.monitor, mode=best.mode, patience=int(cfg.early_stopping_patience),
                                           check_on_train_epoch_end=False, verbose=True))
    if cfg.trainer.get("enable_checkpointing", True):
        callbacks.append(ModelCheckpoint(dirpath=Path(output_dir) / CHECKPOINT_DIR, filename="step-{step}", save_top_k=0,
                                         save_last=True, every_n_train_steps=int(cfg.get("checkpoint_every", 50))))
        callbacks.append(PreemptionCheckpoint(Path(output_dir) / CHECKPOINT_DIR / LAST))
    guard = build_group(cfg, "guard")
    if guard is not None:
        callbacks.append(guard)
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(LCSBProgressBar())
    logger = build(cfg.logger, save_dir=str(output_dir))
    plugins: list[Any] = [AtomicCheckpointIO(), *([mebp] if mebp is not None else [])]
    extra: dict[str, Any] = {"precision": None} if mebp is not None else {}  # the MeBP plugin takes trainer.precision
    trainer: L.Trainer = build(cfg.trainer, callbacks=callbacks, logger=logger, plugins=plugins,
                               default_root_dir=str(output_dir), **extra)
    return trainer, lcsb


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items()
            if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)}


def _hydra_choices() -> dict[str, Any]:
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            hc = HydraConfig.get()
            return {"choices": dict(hc.runtime.choices), "overrides": list(hc.overrides.task)}
    except Exception:  # noqa: BLE001 - the summary is still useful without them
        pass
    return {}


def _callback(trainer: L.Trainer, kind: type[C]) -> C | None:
    return next((cb for cb in trainer.callbacks if isinstance(cb, kind)), None)


def _stop_if_preempted(trainer: L.Trainer, out: Path, interrupted: bool) -> None:
    """Raise :class:`Preempted` (exit status ``128 + signal``) when a signal came during the fit, naming the
    checkpoint to resume from; a signal after the last step (``interrupted`` False) gets the end checkpoint."""
    preemption = _callback(trainer, PreemptionCheckpoint)
    signalled = trainer.received_sigterm or (preemption is not None and preemption.signum is not None)
    if trainer.world_size > 1:  # the ranks stop, and save, together
        signalled = trainer.strategy.reduce_boolean_decision(signalled, all=False)
    if not signalled:
        return
    last = out / CHECKPOINT_DIR / LAST
    if preemption is not None and preemption.saved_step is None and not interrupted:
        trainer.save_checkpoint(last, weights_only=False)
        preemption.saved_step = int(trainer.global_step)
    if preemption is not None and preemption.saved_step is not None:
        where = f"the checkpoint {last} holds step {preemption.saved_step}"
    else:  # a signal before training started, or a run without checkpoints
        where = f"no checkpoint was written on the signal; {last} is the latest one" if last.is_file() else "no checkpoint exists"
    log.warning("preempted at step %d: %s; continue with lcsb-finetune resume=%s", trainer.global_step, where, out)
    raise Preempted(preemption.exit_code() if preemption is not None else 128 + signal.SIGTERM)


def run_finetune(cfg: DictConfig, output_dir: str | Path, extra_callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Fine-tune as configured and write logs, checkpoints, the adapter (and ``adapter_best``), ``summary.json``
    and a loss-curve PNG into ``output_dir``. Every input is checked before the model is loaded. On SIGTERM or SIGINT
    the run checkpoints after the current step and raises :class:`~lcsb_lightning.recipes.checkpointing.Preempted`.

    Args:
        cfg: The composed config (``conf/config.yaml``); with ``resume`` set, the run's own config.
        output_dir: The run directory (with ``resume``: the resumed run's folder).
        extra_callbacks: More Lightning callbacks for the Trainer (the benchmark's recorder).

    Returns:
        The summary.
    """
    start = time.perf_counter()
    check_config(cfg)
    mebp_precision(cfg)
    out = Path(output_dir)
    checkpoint = resolve_checkpoint(cfg.resume) if cfg.get("resume") else None
    if checkpoint is not None:
        check_checkpoint(checkpoint)
    import peft  # noqa: F401  (the libraries a run needs count as imports, not as the run's memory)
    import transformers  # noqa: F401

    memory = RunMemory()
    try:
        return _run(cfg, out, checkpoint, extra_callbacks, memory, start)
    finally:
        memory.close()


def _run(cfg: DictConfig, out: Path, checkpoint: Path | None, extra_callbacks: Sequence[Any], memory: RunMemory,
         start: float) -> dict[str, Any]:
    with memory.phase("load"):
        prepared = prepare(cfg)
        train_loader, eval_loader = make_loaders(prepared.data, cfg, prepared.bundle.tokenizer)
        trainer, lcsb = build_trainer(cfg, out, extra_callbacks, prepared.gguf_base)
    module = prepared.module

    initial: dict[str, float] = {}
    if checkpoint is not None and (out / INITIAL_NAME).is_file():
        initial = json.loads((out / INITIAL_NAME).read_text())
    else:
        if trainer.is_global_zero:
            atomic_write_text(out / RUN_CONFIG_NAME, OmegaConf.to_yaml(cfg, resolve=True))
        if cfg.get("eval_before_training", True):
            with memory.phase("initial_eval"):
                initial = _scalars(trainer.validate(module, eval_loader, verbose=False)[0])
            if trainer.is_global_zero:
                atomic_write_json(out / INITIAL_NAME, initial)
    fit_start = time.perf_counter()
    interrupted = False
    try:
        with memory.phase("train"):
            trainer.fit(module, train_loader, eval_loader, ckpt_path=str(checkpoint) if checkpoint is not None else None,
                        weights_only=True)
    except SIGTERMException:
        interrupted = True  # stopped on SIGTERM/SIGINT: _stop_if_preempted says where to resume
    _stop_if_preempted(trainer, out, interrupted)
    fit_seconds = time.perf_counter() - fit_start
    with memory.phase("final_eval"):
        if cfg.trainer.get("enable_checkpointing", True):
            trainer.save_checkpoint(out / CHECKPOINT_DIR / LAST, weights_only=False)  # the end state, whatever the interval
        final = _scalars(trainer.validate(module, eval_loader, verbose=False)[0])

    timer, guard = _callback(trainer, StepTimer), _callback(trainer, DivergenceGuard)
    best, stopper = _callback(trainer, BestAdapter), _callback(trainer, EarlyStopping)
    steps = int(trainer.global_step)
    train_seconds = (timer.total_seconds if timer is not None else 0.0) or fit_seconds
    summary: dict[str, Any] = {
        "model": prepared.bundle.name,
        "model_file": prepared.bundle.weights_file,  # the GGUF read, if any, and its formats as stored (mebp)
        "stored_formats": stored_formats(module.model),
        "task": type(prepared.task).__name__,
        "task_kind": prepared.task.kind,
        "policy": type(lcsb.policy).__name__ if lcsb is not None else None,
        "initial_metrics": initial,
        "final_metrics": final,
        "steps": steps,
        "resumed_from": str(checkpoint) if checkpoint is not None else None,
        # the step early stopping ended the run at; None: it ran to its end (or had no early stopping)
        "stopped_early_at": steps if stopper is not None and stopper.stopping_reason_message is not None else None,
        "divergence_events": list(guard.events) if guard is not None else [],
        "train_examples": len(prepared.data.train),
        "eval_examples": len(prepared.data.eval),
        "skipped_examples": prepared.data.skipped,
        "fit_seconds": round(fit_seconds, 3),
        "train_step_seconds": round(train_seconds, 3),
        "steps_per_second": round(steps / train_seconds, 4) if train_seconds > 0 else None,
        "wall_seconds": round(time.perf_counter() - start, 3),
        "lora_parameters": sum(p.numel() for n, p in module.model.named_parameters() if "lora_" in n),
        "num_blocks": len(lcsb.selection_counts) if lcsb is not None else 0,
        "block_selection_counts": list(lcsb.selection_counts) if lcsb is not None else [],
        "adapter_dir": str(out / ADAPTER_NAME),
        "gguf": ({"base": prepared.gguf_base, "adapter": str(out / f"{ADAPTER_NAME}.gguf"),
                  "merged": str(out / MERGED_NAME) if _merges(cfg) else None} if prepared.gguf_base else None),
        "best": ({"monitor": best.monitor, "value": best.best_value, "step": best.best_step,
                  "adapter_dir": str(out / BEST_ADAPTER_NAME)} if best is not None and best.best_step is not None else None),
        "log_dir": str(getattr(trainer.logger, "log_dir", out)),
        **_hydra_choices(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    curve = None
    if trainer.is_global_zero:
        with memory.phase("save"):
            save_adapters(module.model, out / ADAPTER_NAME, prepared.gguf_base)  # adapter_best/: by BestAdapter
            if _merges(cfg):
                save_merged_gguf(module.model, prepared.gguf_base, out / MERGED_NAME, str(cfg.export.merged_type))
        with memory.phase("plots"):
            curve = write_loss_curve(summary["log_dir"], out / LOSS_CURVE_NAME)
    # Measured to here (the summary's own write is a few KB); the whole-process peak is the kernel's.
    summary["memory"] = memory.summary()
    summary["peak_rss_mb"] = summary["memory"]["peak_rss_mib"]
    if trainer.is_global_zero:
        atomic_write_json(out / SUMMARY_NAME, summary)
        log.info("\n%s", final_table(summary, curve))
    return summary
