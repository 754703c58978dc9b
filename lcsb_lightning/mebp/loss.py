"""Chunked LM-head cross-entropy: full-vocabulary logits never exist for the whole sequence."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss(
    hidden: torch.Tensor, labels: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], ignore_index: int
) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def chunked_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    chunk_size: int = 256,
    ignore_index: int = -100,
    shift_labels: bool = True,
) -> torch.Tensor:
    """Mean next-token cross-entropy computed ``chunk_size`` tokens at a time.

    Each chunk's logits are computed, reduced to a summed loss and dropped; backward recomputes them
    (non-reentrant checkpoint), so at most ``chunk_size x vocab`` logits exist at once. The result
    equals ``F.cross_entropy(lm_head(h).flatten(0, 1), labels.flatten())`` with HF's label shift.

    Args:
        hidden_states: ``(batch, seq, hidden)`` output of the final norm.
        lm_head: The output projection (a ``CompressedLinear`` decompresses in row chunks).
        labels: ``(batch, seq)`` token ids, ``ignore_index`` where no loss is wanted.
        chunk_size: Tokens per chunk (over the flattened batch and sequence).
        ignore_index: Label value excluded from the mean.
        shift_labels: Predict token ``t + 1`` from position ``t`` (as HF causal LMs do).

    Example::

        >>> head = torch.nn.Linear(8, 50)
        >>> h, y = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
        >>> ref = torch.nn.functional.cross_entropy(head(h)[:, :-1].flatten(0, 1), y[:, 1:].flatten())
        >>> bool(torch.allclose(chunked_lm_loss(h, head, y, chunk_size=4), ref, atol=1e-6))
        True
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive integer, got {chunk_size!r}.")
    if hidden_states.dim() != 3 or labels.shape != hidden_states.shape[:2]:
        raise ValueError(
            f"Expected `hidden_states` (batch, seq, hidden) and `labels` (batch, seq); got "
            f"{tuple(hidden_states.shape)} and {tuple(labels.shape)}."
        )
    if shift_labels:
        hidden_states, labels = hidden_states[:, :-1], labels[:, 1:]
    flat_hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    flat_labels = labels.reshape(-1).to(flat_hidden.device)
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_hidden.shape[0], chunk_size):
        h, y = flat_hidden[start : start + chunk_size], flat_labels[start : start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            total = total + checkpoint(_chunk_loss, h, y, lm_head, ignore_index, use_reentrant=False)
        else:
            total = total + _chunk_loss(h, y, lm_head, ignore_index)
    count = (flat_labels != ignore_index).sum().clamp(min=1)
    return total / count
