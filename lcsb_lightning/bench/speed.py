"""Speed study: steps/s of the random-init shapes, the arms alternating step by step in one process.

Every arm is LoRA on a ``QuantizedMeBP`` model built straight in compressed form
(:func:`~lcsb_lightning.mebp.load_compressed` from the random-init shape), trained through
:class:`~lcsb_lightning.controller.LCSBController` with the study's backward mode and implicit momentum;
full backprop is ``FullPolicy`` through the same code path. Memory is the ``memory`` study's.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lcsb_lightning.controller import LCSBController
from lcsb_lightning.policies import CyclicPolicy, FullPolicy, SelectionPolicy



def make_policy(fraction: float) -> SelectionPolicy:
    """``FullPolicy`` for ``fraction >= 1``, else the paper's ``CyclicPolicy`` with that fraction."""
    return FullPolicy() if fraction >= 1.0 else CyclicPolicy(fraction=fraction)


def build_model(model_config: Mapping[str, Any], fmt: str, rank: int, seed: int, group_size: int = 64) -> nn.Module:
    """LoRA (rank ``rank``, all seven projections) on a compressed random-init model of the given shape.

    Args:
        model_config: The ``config`` node of a ``conf/model`` random-init option (with ``_target_``).
        fmt: ``nf4``, ``fp4`` or ``int4``.
        rank: LoRA rank.
        seed: Random-init seed.
        group_size: Weights per scale.
    """
    from hydra.utils import instantiate
    from peft import LoraConfig, get_peft_model

    from lcsb_lightning.mebp import load_compressed

    config = instantiate(dict(model_config))
    torch.manual_seed(seed)
    model = load_compressed(config, fmt=fmt, group_size=group_size, checkpoint=True, seed=seed)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(model, lora)
    model.train()
    return model


def lm_loss(model: nn.Module, tokens: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
    """Next-token loss; with ``chunk_size`` through ``chunked_lm_loss`` (no full-vocabulary logits)."""
    if not chunk_size:
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss
    from lcsb_lightning.mebp import chunked_lm_loss

    base = model.get_base_model()
    hidden = getattr(base, base.base_model_prefix)(input_ids=tokens, use_cache=False).last_hidden_state
    return chunked_lm_loss(hidden, base.get_output_embeddings(), tokens, chunk_size=chunk_size)


class ArmStepper:
    """Runs optimizer steps of several arms (policies) on one model, one controller per step."""

    def __init__(self, model: nn.Module, fractions: Mapping[str, float], tokens: torch.Tensor, chunk_size: int | None,
                 backward: str = "identity"):
        self.model, self.tokens, self.chunk_size, self.backward = model, tokens, chunk_size, backward
        self.policies = {name: make_policy(f) for name, f in fractions.items()}
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
        self.step_index = {name: 0 for name in fractions}
        self.k: dict[str, int] = {}
        self.num_blocks = 0

    def step(self, name: str) -> float:
        """One optimizer step of arm ``name``; returns its wall time in seconds."""
        start = time.perf_counter()
        controller = LCSBController(self.model, self.policies[name], backward=self.backward)
        try:
            selection = controller.begin_step(self.step_index[name]) or ()
            self.k[name], self.num_blocks = len(selection), controller.num_blocks
            lm_loss(self.model, self.tokens, self.chunk_size).backward()
            controller.before_optimizer_step(self.optimizer)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            controller.release()
        self.step_index[name] += 1
        return time.perf_counter() - start

    def forward_only(self) -> float:
        """Forward with autograd recording (as in training), graph dropped: ``T_fwd`` of the Amdahl bound."""
        start = time.perf_counter()
        lm_loss(self.model, self.tokens, self.chunk_size)
        return time.perf_counter() - start


def whole_cycle_step_time(times: Sequence[float], cycle: int) -> float:
    """The median over consecutive windows of ``cycle`` steps of their mean (steps past the last whole window
    are left out): a run pays each kind of step in its share, and a disturbed window does not count.

    Example::

        >>> whole_cycle_step_time([3.0, 1.0, 3.0, 1.0, 9.0, 9.0, 2.0], cycle=2)  # the median step says 3.0
        2.0

    Raises:
        ValueError: fewer than ``cycle`` steps.
    """
    if len(times) < cycle:
        raise ValueError(f"{len(times)} timed steps do not cover one cycle of {cycle} steps: time at least {cycle}.")
    windows = [statistics.fmean(times[i:i + cycle]) for i in range(0, len(times) - cycle + 1, cycle)]
    return statistics.median(windows)


def time_arms(
    model: nn.Module, fractions: Mapping[str, float], seq_len: int, steps: int, warmup: int = 1,
    chunk_size: int | None = 64, vocab: int = 256, log: Callable[[str], None] = print, backward: str = "identity",
) -> dict[str, Any]:
    """Step time per arm, the arms alternating step by step in this process: the median over consecutive
    whole cycles of the arm's policy of their mean step time (:func:`whole_cycle_step_time`; with
    ``backward="all_reached"`` a cyclic arm's step costs more the lower its group).

    Returns:
        ``{"arms": {name: {"median_s", "steps_per_s", "times", "k"}}, "forward_median_s", "num_blocks", "loadavg"}``
        (``median_s``: that step time).

    Raises:
        ValueError: ``steps`` is shorter than an arm's cycle (after the warm-up steps, before any timing).
    """
    tokens = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    stepper = ArmStepper(model, fractions, tokens, chunk_size, backward)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in fractions}
    forward: list[float] = []
    for _ in range(warmup):
        for name in fractions:
            stepper.step(name)
    cycles = {name: stepper.policies[name].cycle_steps or 1 for name in fractions}  # known once set up
    if any(steps < cycle for cycle in cycles.values()):
        raise ValueError(f"`steps={steps}` do not cover one cycle of every arm's policy ({cycles}): time at least "
                         f"{max(cycles.values())} steps.")
    for i in range(steps):
        for name in fractions:
            times[name].append(stepper.step(name))
        forward.append(stepper.forward_only())
        log(f"  round {i + 1}/{steps}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))
    per_step = {name: whole_cycle_step_time(t, cycles[name]) for name, t in times.items()}
    arms = {name: {"median_s": per_step[name], "steps_per_s": 1.0 / per_step[name], "times": t, "k": stepper.k.get(name)}
            for name, t in times.items()}
    return {"arms": arms, "forward_median_s": statistics.median(forward), "num_blocks": stepper.num_blocks,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "threads": torch.get_num_threads()}
