"""The arms of the GPU check and their training step: ``qlora``, ``mebp``, ``mebp_lcsb`` (see the package docstring).

:func:`run` builds and warms up the arms one after another, then alternates their measured steps
round-robin (the order rotating per round).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .report import build_result, environment, to_mib

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2.5_0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True},
}
ARMS: tuple[str, ...] = ("qlora", "mebp", "mebp_lcsb")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak(device: torch.device, reset: bool = False) -> int:
    """``max_memory_allocated`` since the last reset (0 off CUDA); ``reset`` starts a new peak first."""
    if device.type != "cuda":
        return 0
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.max_memory_allocated(device)


def model_config(shape: str) -> Any:
    """The ``transformers.Qwen2Config`` of ``shape``."""
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape])


def save_random_init(config: Any, folder: Path, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
    """Save a random init of ``config`` (seeded, built on ``device``, saved in ``dtype``) unless ``folder`` has one."""
    if (folder / "config.json").is_file():
        return
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)


@dataclass
class Arm:
    """One arm: its model, optimizer, MeBP blocks and stats (MeBP arms), LCSB controller (``mebp_lcsb``)."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    controller: Any = None
    blocks: list[nn.Module] = field(default_factory=list)
    stats: Any = None
    step_index: int = 0


@dataclass
class StepRecord:
    """One optimizer step: loss, wall time, peak bytes above the step's start, back-propagated blocks."""

    loss: float
    seconds: float
    start_bytes: int
    transient_bytes: int
    backward_blocks: tuple[int, ...] | None  # MeBP arms: blocks with at least one backward decompression
    mebp: dict[str, float] = field(default_factory=dict)


def build_arm(name: str, folder: Path, device: torch.device, dtype: torch.dtype, rank: int = 8, lr: float = 1e-4,
              fraction: float = 0.25, backward: str = "all_reached") -> Arm:
    """Build one arm (see the module docstring) from the random-init ``folder``.

    Args:
        name: ``"qlora"``, ``"mebp"`` or ``"mebp_lcsb"``.
        folder: The safetensors folder :func:`save_random_init` wrote.
        device: Where the arm trains.
        dtype: Compute dtype (bitsandbytes' compute dtype, ``load_compressed``'s float parameters).
        rank, lr: LoRA rank (``lora_alpha = 2 * rank``), AdamW's learning rate.
        fraction, backward: ``LCSBCallback``'s ``fraction`` and ``backward`` (``mebp_lcsb``).

    Raises:
        ValueError: an unknown arm.
    """
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    blocks: list[nn.Module] = []
    stats = None
    if name == "qlora":
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        target = "cpu" if device.type == "cpu" else device.index if device.index is not None else torch.cuda.current_device()
        base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map={"": target}, dtype=dtype)
        base.config.use_cache = False
        enable = getattr(base, "activation_checkpointing_enable", None) or base.gradient_checkpointing_enable  # < 5.24
        enable({"use_reentrant": False})
        model = get_peft_model(base, lora)
    elif name in ("mebp", "mebp_lcsb"):
        from lcsb_lightning import mebp

        base = mebp.load_compressed(folder, fmt="nf4", group_size=64, checkpoint=True, dtype=dtype)
        mebp.QuantizedMeBP(fmt="nf4", group_size=64).convert_module(base)  # what Trainer.fit does: a no-op here
        model = get_peft_model(base, lora).to(device)
        state = mebp.mebp_state(model)
        assert state is not None
        blocks, stats = list(state.blocks), state.stats
    else:
        raise ValueError(f"unknown arm {name!r}; choose one of {', '.join(ARMS)}")
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    controller = None
    if name == "mebp_lcsb":
        from lcsb_lightning import LCSBCallback
        from lcsb_lightning.controller import LCSBController

        cb = LCSBCallback("cyclic", fraction=fraction, backward=backward, log_every_n_steps=0)
        controller = LCSBController(model, cb.policy, cb.backward, cb.unreached, cb.blocks)  # as in its on_fit_start
    return Arm(name, model, optimizer, device, controller, blocks, stats)


def arm_loss(arm: Arm, ids: torch.Tensor) -> torch.Tensor:
    """HF's loss for ``qlora``; ``chunked_lm_loss`` on the last hidden state for the MeBP arms."""
    if arm.name == "qlora":
        return arm.model(input_ids=ids, labels=ids, use_cache=False).loss
    from lcsb_lightning.mebp import chunked_lm_loss

    causal_lm = arm.model.get_base_model()
    hidden = getattr(causal_lm, causal_lm.base_model_prefix)(input_ids=ids, use_cache=False).last_hidden_state
    return chunked_lm_loss(hidden, causal_lm.get_output_embeddings(), ids, chunk_size=ids.shape[1])


def _backward_counts(blocks: list[nn.Module]) -> list[int]:
    return [sum(m.decompress_count["backward"] for m in b.modules() if hasattr(m, "decompress_count")) for b in blocks]


def train_step(arm: Arm, ids: torch.Tensor, instrument: bool = False) -> StepRecord:
    """One optimizer step of ``arm`` on ``ids``, the device synchronized around it and around ``backward``.

    Args:
        arm: The arm (its ``step_index`` advances).
        ids: ``(batch, seq)`` token ids; the labels are the same ids, shifted.
        instrument: Turn MeBP's timers on (they synchronize around every decompression) and return them.
    """
    before, stats = _backward_counts(arm.blocks), arm.stats
    enabled = getattr(stats, "enabled", False)
    if stats is not None:
        stats.enabled = instrument
        stats.reset()
    try:
        _sync(arm.device)
        start_bytes, _ = _allocated(arm.device), _peak(arm.device, reset=True)
        start = time.perf_counter()
        if arm.controller is not None:
            arm.controller.begin_step(arm.step_index)
        loss = arm_loss(arm, ids)
        _sync(arm.device)
        backward_start = time.perf_counter()
        loss.backward()
        _sync(arm.device)
        if stats is not None:
            stats.backward_ms += (time.perf_counter() - backward_start) * 1e3
        if arm.controller is not None:
            arm.controller.before_optimizer_step(arm.optimizer)
        arm.optimizer.step()
        arm.optimizer.zero_grad(set_to_none=True)
        _sync(arm.device)
        seconds = time.perf_counter() - start
        mebp = stats.as_dict() if instrument and stats is not None else {}
    finally:
        if stats is not None:
            stats.enabled = enabled
    arm.step_index += 1
    after = _backward_counts(arm.blocks)
    blocks = tuple(i for i, (a, b) in enumerate(zip(before, after)) if b > a) if arm.blocks else None
    return StepRecord(float(loss.detach()), seconds, start_bytes, _peak(arm.device) - start_bytes, blocks, mebp)


def _summary(fig: dict[str, Any], arm: Arm, recs: list[StepRecord]) -> None:
    """Fold the arm's measured steps into its figures."""
    times = [r.seconds for r in recs]
    fig.update(step_s_mean=statistics.fmean(times), step_s_median=statistics.median(times),
               step_s_all=[round(t, 5) for t in times], loss_last=recs[-1].loss)
    resident = fig.pop("resident_bytes")
    fig.update(resident_mib=to_mib(resident), peak_mib=to_mib(resident + max(r.transient_bytes for r in recs)))
    if arm.blocks:
        fig.update(num_blocks=len(arm.blocks),
                   backward_blocks_mean=statistics.fmean(len(r.backward_blocks or ()) for r in recs))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build and warm up the arms of ``args`` one by one, then time them round-robin.

    Returns:
        The document :func:`build_result` makes (CUDA memory figures are ``None`` off CUDA).
    """
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(args.shape)
    gen = torch.Generator().manual_seed(args.seed)
    batches = torch.randint(0, config.vocab_size, (args.warmup + args.steps + 1, 1, args.seq_len), generator=gen).to(device)
    figures: dict[str, dict[str, Any]] = {}
    arms: dict[str, Arm] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        folder = args.model_dir or Path(tmp) / "random_init"
        save_random_init(config, folder, dtype, device, args.seed)
        gc.collect()
        warm = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)  # cuBLAS workspaces before baselines
        (warm @ warm).sum().backward()
        try:
            for name in args.arms:  # build and warm up one arm at a time
                gc.collect()
                base, _ = _allocated(device), _peak(device, reset=True)
                start = time.perf_counter()
                arm = arms[name] = build_arm(name, folder, device, dtype, backward=args.lcsb_backward)
                fig = figures[name] = {"load_s": round(time.perf_counter() - start, 2),
                                       "load_peak_mib": to_mib(_peak(device) - base)}
                warmup = [train_step(arm, batches[i]) for i in range(args.warmup)]
                fig["loss_first"] = warmup[0].loss
                fig["warmup_peak_mib"] = to_mib(max(r.start_bytes + r.transient_bytes for r in warmup) - base)
                fig["resident_bytes"] = _allocated(device) - base
            records: dict[str, list[StepRecord]] = {name: [] for name in arms}
            names = list(arms)
            for r in range(args.steps):  # round robin, the order rotating per round
                for name in names[r % len(names):] + names[:r % len(names)]:
                    records[name].append(train_step(arms[name], batches[args.warmup + r]))
            for name, arm in arms.items():
                _summary(figures[name], arm, records[name])
                if arm.blocks:
                    figures[name]["mebp"] = train_step(arm, batches[-1], instrument=True).mebp
        finally:
            for arm in arms.values():
                if arm.controller is not None:
                    arm.controller.release()  # the LCSB forward wrappers come off
    if device.type != "cuda":  # no CUDA memory figures on a CPU test run
        for fig in figures.values():
            fig.update(dict.fromkeys(("peak_mib", "resident_mib", "warmup_peak_mib", "load_peak_mib")))
    meta = {**environment(device), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "shape": args.shape, "config": SHAPES[args.shape], "seq_len": args.seq_len, "batch": 1,
            "lora": "r8, alpha 16, all-linear", "optimizer": "AdamW lr 1e-4", "steps": args.steps,
            "warmup": args.warmup, "lcsb": {"policy": "cyclic", "fraction": 0.25, "backward": args.lcsb_backward}}
    return build_result(meta, figures)
