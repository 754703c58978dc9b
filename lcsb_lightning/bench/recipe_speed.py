"""Step time inside the recipe's own training loop, per phase (:data:`PHASES`), the arms alternating in one process.

Arms that would build the same model and data share them (:func:`model_key`). Each round, every arm fits one
warm-up step and ``steps_per_round`` timed ones (whole cycles of its policy) through a fresh ``Trainer`` built as
``lcsb-finetune`` builds it, from epoch 0 of the same seeded permutation; its figure is the mean over a round's timed
steps (a dyadic cycle's deep step counts in full), then the median over rounds (a disturbed round does not count).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

from lcsb_lightning.validation import check_int

log = logging.getLogger(__name__)
PHASES = ("forward", "zero_grad", "backward", "before_step", "clip", "optimizer", "between")


class PhaseTimer(Callback):
    """Wall time of each phase of every training step (place it after every other callback).

    Args:
        lm_head_of: A function of the LightningModule that returns the module whose forward and backward to
            time (the LM head), called at the start of training: after a precision plugin such as
            QuantizedMeBP's has replaced the model's modules (hooks on the module before would never fire).
    """

    def __init__(self, lm_head_of: Callable[[LightningModule], torch.nn.Module] | None = None) -> None:
        self.steps: list[dict[str, float]] = []
        self._marks: dict[str, float] = {}
        self._last_end: float | None = None
        self._lm_head_ms = {"forward": 0.0, "backward": 0.0}
        self._head_t0 = 0.0
        self._handles: list[Any] = []
        self._lm_head_of = lm_head_of

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._lm_head_of is None:
            return
        self.remove_hooks()
        lm_head = self._lm_head_of(pl_module)
        self._handles = [
            lm_head.register_forward_pre_hook(lambda *_: self._head_start(first_forward=True)),
            lm_head.register_forward_hook(lambda *_: self._head_stop("forward")),
            lm_head.register_full_backward_pre_hook(lambda *_: self._head_start()),
            lm_head.register_full_backward_hook(lambda *_: self._head_stop("backward")),
        ]

    def _head_start(self, first_forward: bool = False) -> None:
        self._head_t0 = time.perf_counter()
        if first_forward:
            self._marks.setdefault("head_start", self._head_t0)

    def _head_stop(self, phase: str) -> None:
        self._lm_head_ms[phase] += (time.perf_counter() - self._head_t0) * 1e3

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def wrap_clipping(self, trainer: Trainer) -> None:
        """Time ``clip_gradients`` of the precision plugin (an instance attribute, removed by :meth:`unwrap_clipping`)."""
        plugin = trainer.precision_plugin
        clip = plugin.clip_gradients

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return clip(*args, **kwargs)
            finally:
                self._marks["clip_s"] = self._marks.get("clip_s", 0.0) + time.perf_counter() - start

        plugin.clip_gradients = timed  # type: ignore[method-assign]

    @staticmethod
    def unwrap_clipping(trainer: Trainer) -> None:
        vars(trainer.precision_plugin).pop("clip_gradients", None)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        between = now - self._last_end if self._last_end is not None else None
        self._marks = {"start": now, "between": between} if between is not None else {"start": now}
        self._lm_head_ms = {"forward": 0.0, "backward": 0.0}

    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._marks["forward_end"] = time.perf_counter()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._marks["zero_grad_end"] = time.perf_counter()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._marks["backward_end"] = time.perf_counter()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._marks["before_step_end"] = time.perf_counter()  # after the callbacks listed before this one

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        end = time.perf_counter()
        m = self._marks
        if not {"forward_end", "zero_grad_end", "backward_end", "before_step_end"} <= m.keys():
            return
        clip = m.get("clip_s", 0.0)
        row = {
            "forward": m["forward_end"] - m["start"],
            "zero_grad": m["zero_grad_end"] - m["forward_end"],
            "backward": m["backward_end"] - m["zero_grad_end"],
            "before_step": m["before_step_end"] - m["backward_end"],
            "clip": clip,
            "optimizer": end - m["before_step_end"] - clip,
            "lm_head_forward": self._lm_head_ms["forward"] / 1e3,
            "lm_head_backward": self._lm_head_ms["backward"] / 1e3,
        }
        if "between" in m:
            row["between"] = m["between"]
        if "head_start" in m:
            row["lm_head_and_loss"] = m["forward_end"] - m["head_start"]
        row["total"] = sum(row[p] for p in PHASES if p in row)
        self.steps.append(row)
        self._last_end = end


def summarize(rounds: Sequence[Sequence[Mapping[str, float]]]) -> dict[str, float]:
    """Each phase's (``total`` included) mean over every round's timed steps, then the median over rounds.

    Example::

        >>> cycle = [{"total": t} for t in (3.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0)]  # one dyadic cycle
        >>> summarize([cycle, cycle, [{"total": 9.0}] * 8])  # the median of the steps would say 1.0
        {'total': 1.375}
    """
    keys = sorted({k for steps in rounds for s in steps for k in s})
    return {k: statistics.median([statistics.fmean(s[k] for s in steps if k in s) for steps in rounds
                                  if any(k in s for s in steps)]) for k in keys}


def check_whole_cycles(policies: Mapping[str, Any], steps_per_round: int) -> None:
    """Refuse a round that does not cover whole cycles of an arm's policy (``{arm: policy or None}``). A
    policy whose cycle needs the model's blocks (``cycle_steps`` is None before ``setup``: cyclic) is not
    checked.

    Raises:
        ValueError: naming the arm, its cycle and ``steps_per_round``.
    """
    steps_per_round = check_int("steps_per_round", steps_per_round, 1)
    for name, policy in policies.items():
        cycle = getattr(policy, "cycle_steps", None)
        if cycle and steps_per_round % cycle:
            raise ValueError(
                f"`steps_per_round={steps_per_round}` does not cover whole cycles of arm {name!r}'s {policy!r}, "
                f"whose steps repeat every {cycle}: the mean would over- or under-weight its deep steps. "
                f"Allowed: a multiple of {cycle}."
            )


#: The config entries that decide the model, its LoRA and optimizer, its 4-bit conversion and the training data.
MODEL_KEYS = ("seed", "data_dir", "seq_len", "batch_size", "model", "task", "lora", "module", "mebp", "keep_activations")


def model_key(cfg: DictConfig) -> str:
    """What an arm's model and data are built from: arms with the same key can share them."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return json.dumps({key: resolved.get(key) for key in MODEL_KEYS}, sort_keys=True, default=str)


def time_task(task: str, arms: Mapping[str, Sequence[str]], common: Sequence[str], compose: Any, rounds: int,
              steps_per_round: int, out_dir: Any) -> dict[str, Any]:
    """Alternate the arms of one task round by round; return each arm's step time per phase and every round's steps.

    Args:
        task: The task option (``task=<task>``).
        arms: Arm name -> overrides (its ``policy`` and mode).
        common: Overrides of every arm (model, data, sequence length, ...).
        compose: Composes the fine-tuning config from overrides.
        rounds: Rounds over all arms.
        steps_per_round: Timed optimizer steps per arm and round, after one warm-up step; a multiple of
            every arm's policy cycle (:attr:`~lcsb_lightning.policies.SelectionPolicy.cycle_steps`).
        out_dir: Folder for the arms' TensorBoard logs.

    Raises:
        ValueError: ``rounds`` or ``steps_per_round`` is no integer >= 1, or ``steps_per_round`` does not cover
            whole cycles of an arm's policy (before any work).
    """
    from lcsb_lightning.recipes.train import build_group, build_trainer, make_loaders, prepare

    rounds, steps_per_round = check_int("rounds", rounds, 1), check_int("steps_per_round", steps_per_round, 1)

    configs = {name: compose([*common, f"task={task}", *overrides, f"trainer.max_steps={steps_per_round + 1}",
                              "trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=null",
                              "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0"])
               for name, overrides in arms.items()}
    check_whole_cycles({name: build_group(cfg, "policy") for name, cfg in configs.items()}, steps_per_round)
    # Arms share a model only where they would build the same one: QuantizedMeBP compresses the model it
    # trains in place, so a float arm must never run on the model an int4 arm has trained.
    models: dict[str, tuple[Any, Any]] = {}  # model_key -> (module, training loader)
    fit_args: dict[str, tuple[Any, Any]] = {}
    for name, cfg in configs.items():
        if (key := model_key(cfg)) not in models:
            prepared = prepare(cfg)
            models[key] = (prepared.module, make_loaders(prepared.data, cfg, prepared.bundle.tokenizer)[0])
        fit_args[name] = models[key]
    raw: dict[str, list[list[dict[str, float]]]] = {name: [] for name in arms}
    load_before = list(os.getloadavg())
    for round_index in range(rounds):
        for name, cfg in configs.items():
            timer = PhaseTimer(lambda module: module.model.get_base_model().get_output_embeddings())
            trainer, _ = build_trainer(cfg, f"{out_dir}/{name}", [timer])
            timer.wrap_clipping(trainer)
            try:
                trainer.fit(*fit_args[name])
            finally:
                timer.remove_hooks()
                timer.unwrap_clipping(trainer)
            raw[name].append(timer.steps[1:])
            log.info("recipe speed %s round %d/%d %s: %.3f s/step", task, round_index + 1, rounds, name,
                     statistics.fmean([s["total"] for s in timer.steps[1:]] or [float("nan")]))
    return {"task": task, "arms": {name: summarize(steps) for name, steps in raw.items()}, "raw": raw,
            "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()), "threads": torch.get_num_threads()}
