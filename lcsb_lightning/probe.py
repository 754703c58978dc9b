"""Gradient-fidelity probe: how close is the gradient a selective step used to the exact one?

On a probe step the exact gradient of every managed block parameter is computed once more on the same
batch (full backprop, through ``torch.autograd.grad``, so ``.grad`` and gradient-synchronisation
hooks are untouched) and compared, block by block, with the gradient the step is about to apply:
the cosine similarity and the norm ratio ``|used| / |exact|``. Blocks that did not train this step
(their gradient is zero or absent) are left out.
"""

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
    step: int,
    params_per_block: Sequence[Sequence[nn.Parameter]],
    selection: Sequence[int],
    exact_loss: Callable[[], torch.Tensor],
    selective: SelectiveBackprop | None,
) -> ProbeResult:
    """Compare the gradients in ``.grad`` of the ``selection`` blocks with their exact gradients.

    Args:
        step: The optimizer step (recorded in the result).
        params_per_block: The trainable parameters of each block.
        selection: The blocks that trained this step.
        exact_loss: Recomputes the step's loss on the same batch (called once, with every block selected).
        selective: LCSB's layers, switched to full backprop for the recomputation and restored after.

    Returns:
        The per-block cosines and norm ratios.
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
