"""Gradient-fidelity probe: per trained block, the cosine and norm ratio ``|used| / |exact|`` of the gradient a
selective step is about to apply to the exact one, recomputed on the same batch through ``torch.autograd.grad``
(``.grad`` and gradient-synchronisation hooks untouched)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lcsb_lightning.selective import SelectiveBackprop


@dataclass
class ProbeResult:
    """One probe: per selected block, the cosine and norm ratio of the used vs the exact gradient."""

    step: int
    cosine: dict[int, float] = field(default_factory=dict)
    norm_ratio: dict[int, float] = field(default_factory=dict)


def _flat(tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(t if t is not None else torch.zeros_like(p)).detach().float().reshape(-1) for t, p in zip(tensors, like)])


def probe_gradients(
    step: int, params_per_block: Sequence[Sequence[nn.Parameter]], selection: Sequence[int],
    exact_loss: Callable[[], torch.Tensor], selective: SelectiveBackprop | None
) -> ProbeResult:
    """Compare the gradients in ``.grad`` of the ``selection`` blocks with their exact gradients.

    ``exact_loss`` recomputes the step's loss on the same batch, with ``selective`` (LCSB's wrappers) switched to
    full backprop and restored after; ``step`` is recorded in the result.
    """
    chosen = [i for i in selection if params_per_block[i]]
    result = ProbeResult(step)
    if not chosen:
        return result
    previous = selective.selected if selective is not None else None
    if selective is not None:
        selective.clear()
    try:
        with torch.enable_grad():
            loss = exact_loss()
            flat_params = [p for i in chosen for p in params_per_block[i]]
            exact = torch.autograd.grad(loss, flat_params, allow_unused=True)
    finally:
        if selective is not None and previous is not None:
            selective.set_selection(previous)
    offset = 0
    for i in chosen:
        params = params_per_block[i]
        used = _flat([p.grad for p in params], params)
        true = _flat(exact[offset : offset + len(params)], params)
        offset += len(params)
        true_norm = float(true.norm())
        if true_norm == 0.0:
            continue
        result.cosine[i] = float(torch.nn.functional.cosine_similarity(used, true, dim=0))
        result.norm_ratio[i] = float(used.norm()) / true_norm
    return result
