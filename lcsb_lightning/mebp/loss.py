"""Chunked LM-head cross-entropy: full-vocabulary logits never exist for the whole sequence.

A frozen ``nn.Linear`` head (a ``CompressedLinear`` included) streams over vocabulary blocks with an online
log-sum-exp that also accumulates the input gradient; any other head runs per token chunk under a checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lcsb_lightning.mebp.compressed import MAX_CHUNK_ELEMENTS, CompressedLinear
from lcsb_lightning.validation import check_int

#: Head weights decompressed (and logits computed per token) per vocabulary block: 4 MiB in float32. 16 MiB blocks
#: held 15-20 MiB more at the phone-budget run's peaks (SmolLM2, docs/log/0.9.md).
VOCAB_BLOCK_ELEMENTS = 1 << 20


def _weight_blocks(head: nn.Linear, dtype: torch.dtype, phase: str) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor | None]]:
    """``(rows, weight[rows], bias[rows])`` over the head's output rows, decompressing if needed."""
    step = max(1, min(VOCAB_BLOCK_ELEMENTS, getattr(head, "max_chunk_elements", MAX_CHUNK_ELEMENTS)) // head.in_features)
    compressed = isinstance(head, CompressedLinear)
    for start in range(0, head.out_features, step):
        rows = slice(start, min(start + step, head.out_features))
        if compressed:
            with head.timed(phase, head.weight.device):
                weight = head.decompress_rows(rows, dtype)
        else:
            weight = head.weight[rows].to(dtype)
        yield rows, weight, head.bias[rows].to(dtype) if head.bias is not None else None
        if compressed:  # the caller is done with this block
            head.give_back(weight)
    if compressed:
        head.decompress_count[phase] += 1


class _BlockScratch:
    """Buffers for a vocabulary block's logits and exponentials, shared by the blocks of one call: allocated
    anew, hundreds per step made a fragmented heap's free pages resident again (docs/mebp.md)."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def matrix(self, name: str, rows: int, columns: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``(rows, columns)`` tensor of ``like``'s dtype and device (one call's), in buffer ``name``."""
        need = rows * columns
        flat = self._flat.get(name)
        if flat is None or flat.numel() < need:
            flat = self._flat[name] = like.new_empty(need)
        return flat[:need].view(rows, columns)


def _block_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float,
                  softcap: float | None, scratch: _BlockScratch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The transformed float logits of one vocabulary block, in ``scratch`` (not under autocast: no ``out=``)."""
    if scratch is None or torch.is_autocast_enabled(hidden.device.type):
        return _transform(F.linear(hidden, weight, bias).float(), scale, softcap)  # float under autocast too
    logits = scratch.matrix("logits", hidden.shape[0], weight.shape[0], hidden)
    if bias is None:
        torch.mm(hidden, weight.t(), out=logits)
    else:
        torch.addmm(bias, hidden, weight.t(), out=logits)
    if scale != 1.0:
        logits.mul_(scale)
    return _transform(logits, 1.0, softcap)


class _OnlineLogSumExp:
    """A per-row log-sum-exp over vocabulary blocks seen one at a time, and each row's logit at its target id."""

    def __init__(self, like: torch.Tensor, targets: torch.Tensor) -> None:
        rows_n = like.shape[0]
        self.running_max = like.new_full((rows_n,), float("-inf"))
        self.running_sum = like.new_zeros(rows_n)
        self.target_logit = like.new_zeros(rows_n)
        self.targets = targets

    def add(self, logits: torch.Tensor, rows: slice, block_max: torch.Tensor | None = None,
            scratch: _BlockScratch | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Take in the logits of vocabulary ``rows``; returns the factor the sums so far were scaled by,
        ``exp(logits - new max)`` (valid until the next block) and the rows whose target is in the block."""
        new_max = torch.maximum(self.running_max, logits.amax(dim=1) if block_max is None else block_max)
        rescale = torch.exp(self.running_max - new_max)
        if scratch is None:
            exp_logits = torch.exp(logits - new_max[:, None])
        else:
            exp_logits = torch.sub(logits, new_max[:, None], out=scratch.matrix("exp", *logits.shape, logits)).exp_()
        self.running_sum = self.running_sum * rescale + exp_logits.sum(1)
        self.running_max = new_max
        inside = ((self.targets >= rows.start) & (self.targets < rows.stop)).nonzero().squeeze(1)
        self.target_logit[inside] = logits[inside, self.targets[inside] - rows.start]
        return rescale, exp_logits, inside

    def logsumexp(self) -> torch.Tensor:
        return self.running_max + torch.log(self.running_sum)


class _StreamingLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ W^T + b`` against ``labels``, streamed over vocabulary blocks: the
    input gradient ``softmax(z) W - W_y`` is accumulated in the forward, the head decompressed once."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, labels: torch.Tensor, head: nn.Linear, ignore_index: int, scale: float,
                softcap: float | None, scratch: _BlockScratch | None = None) -> torch.Tensor:
        hidden = hidden.float()
        need_grad = ctx.needs_input_grad[0]
        online = _OnlineLogSumExp(hidden, labels)
        weighted = torch.zeros_like(hidden) if need_grad else None  # sum_v exp(z_v - m) dz_v W_v
        target_rows = torch.zeros_like(hidden) if need_grad else None  # dz_y W_y
        for rows, weight, bias in _weight_blocks(head, hidden.dtype, "forward"):
            logits, slope = _block_logits(hidden, weight, bias, scale, softcap, scratch)
            rescale, exp_logits, inside = online.add(logits, rows, scratch=scratch)
            if weighted is not None and target_rows is not None:
                picked = labels[inside] - rows.start
                if slope is None:
                    weighted.mul_(rescale[:, None]).addmm_(exp_logits, weight)
                    target_rows[inside] = weight[picked]
                else:
                    weighted.mul_(rescale[:, None]).addmm_(exp_logits * slope, weight)
                    target_rows[inside] = weight[picked] * slope[inside, picked][:, None]
        valid = (labels != ignore_index).to(hidden.dtype)
        if weighted is not None and target_rows is not None:
            grad_hidden = (weighted / online.running_sum[:, None] - target_rows) * (valid[:, None] * scale)
            ctx.save_for_backward(grad_hidden)
        return ((online.logsumexp() - online.target_logit) * valid).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss, None, None, None, None, None, None


def _transform(logits: torch.Tensor, scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own logits (``softcap * tanh(scale * z / softcap)``) and, with a softcap, their slope."""
    if scale != 1.0:
        logits = logits * scale
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, 1.0 - capped.square()


def _chunk_nll(hidden: torch.Tensor, labels: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor],
               ignore_index: int, scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of a chunk through any head, the NLL of ``labels`` (0 at ``ignore_index``), and the logits."""
    logits, _ = _transform(lm_head(hidden).float(), scale, softcap)
    _check_labels(labels, logits.shape[-1], ignore_index)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none"), logits


def _chunk_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor],
                ignore_index: int, scale: float, softcap: float | None) -> torch.Tensor:
    return _chunk_nll(hidden, labels, lm_head, ignore_index, scale, softcap)[0].sum()


def _check_labels(labels: torch.Tensor, vocab_size: Any, ignore_index: int) -> None:
    if not isinstance(vocab_size, int):  # a callable head: checked on its logits
        return
    outside = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(outside.any()):
        raise ValueError(f"label {int(labels[outside][0])} is outside the vocabulary of {vocab_size} (ids "
                         f"0..{vocab_size - 1}); only {ignore_index} (`ignore_index`) may lie outside it.")


def logit_transform(model: nn.Module) -> dict[str, float | None]:
    """``chunked_lm_loss`` keyword arguments that reproduce how ``model`` turns LM-head outputs into logits.

    Reads the Hugging Face config (through peft and Lightning wrappers): Gemma 2/3
    ``final_logit_softcapping``, Cohere ``logit_scale`` (a multiplier), Granite ``logits_scaling`` (a
    divisor). Models without any of them get ``{"logit_scale": 1.0, "logit_softcap": None}``.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)
    softcap = getattr(config, "final_logit_softcapping", None)
    return {"logit_scale": scale, "logit_softcap": float(softcap) if softcap else None}


def _streamable(lm_head: Any) -> bool:
    return isinstance(lm_head, nn.Linear) and not any(p.requires_grad for p in lm_head.parameters())


def chunked_lm_loss(hidden_states: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], labels: torch.Tensor,
                    chunk_size: int = 1024, ignore_index: int = -100, shift_labels: bool = True,
                    logit_scale: float = 1.0, logit_softcap: float | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy computed ``chunk_size`` tokens at a time.

    A frozen ``nn.Linear`` head is streamed over vocabulary blocks; any other head is checkpointed per chunk.
    The result equals ``F.cross_entropy(lm_head(h).flatten(0, 1), labels.flatten())`` with HF's label shift,
    and the model's own loss with the model's ``logit_scale``/``logit_softcap`` (:func:`logit_transform`).

    Args:
        hidden_states: ``(batch, seq, hidden)`` output of the final norm.
        lm_head: The output projection: a frozen ``nn.Linear``/``CompressedLinear`` (streamed), or
            any callable (checkpointed per chunk; use this for a trainable head).
        labels: ``(batch, seq)`` token ids, ``ignore_index`` where no loss is wanted.
        chunk_size: Tokens per chunk (over the flattened batch and sequence).
        ignore_index: Label value excluded from the mean.
        shift_labels: Predict token ``t + 1`` from position ``t`` (as HF causal LMs do).
        logit_scale: Multiplier of the head's outputs before the softmax (Cohere, Granite).
        logit_softcap: ``c`` of ``c * tanh(z / c)`` on the logits (Gemma 2/3 ``final_logit_softcapping``).

    Raises:
        ValueError: on a label outside ``0..vocab-1`` other than ``ignore_index``, before any chunk
            runs when the head's vocabulary size is known.

    Example::

        >>> head = torch.nn.Linear(8, 50).requires_grad_(False)
        >>> h, y = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
        >>> ref = torch.nn.functional.cross_entropy(head(h)[:, :-1].flatten(0, 1), y[:, 1:].flatten())
        >>> bool(torch.allclose(chunked_lm_loss(h, head, y, chunk_size=4), ref, atol=1e-6))
        True
    """
    chunk_size = check_int("chunk_size", chunk_size, 1)
    if hidden_states.dim() != 3 or labels.shape != hidden_states.shape[:2]:
        raise ValueError("Expected `hidden_states` (batch, seq, hidden) and `labels` (batch, seq); got "
                         f"{tuple(hidden_states.shape)} and {tuple(labels.shape)}.")
    if shift_labels:
        hidden_states, labels = hidden_states[:, :-1], labels[:, 1:]
    flat_hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    flat_labels = labels.reshape(-1).to(flat_hidden.device)
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"`logit_softcap` must be > 0 or None, got {logit_softcap!r}.")
    _check_labels(flat_labels, getattr(lm_head, "out_features", None), ignore_index)
    stream = _streamable(lm_head)
    scale, softcap = float(logit_scale), logit_softcap
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    scratch = _BlockScratch()
    for start in range(0, flat_hidden.shape[0], chunk_size):
        h, y = flat_hidden[start : start + chunk_size], flat_labels[start : start + chunk_size]
        if stream:
            total = total + _StreamingLinearCrossEntropy.apply(h, y, lm_head, ignore_index, scale, softcap, scratch)
        elif torch.is_grad_enabled() and h.requires_grad:
            total = total + checkpoint(_chunk_loss, h, y, lm_head, ignore_index, scale, softcap, use_reentrant=False)
        else:
            total = total + _chunk_loss(h, y, lm_head, ignore_index, scale, softcap)
    count = (flat_labels != ignore_index).sum().clamp(min=1)
    return total / count


#: Positions :func:`lm_head_predictions` streams the vocabulary for at once.
PREDICTION_POSITIONS = 256


@torch.no_grad()
def lm_head_predictions(hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                        logit_scale: float = 1.0, logit_softcap: float | None = None,
                        ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, the negative log-likelihood of ``targets`` and the most likely token, without the
    full-vocabulary logits of all positions at once (evaluation metrics); heads as in :func:`chunked_lm_loss`.

    Args:
        hidden: ``(n, hidden)`` final-norm hidden states.
        lm_head: The output layer.
        targets: ``(n,)`` next-token ids (``ignore_index``: an NLL of 0).
        logit_scale, logit_softcap: The model's logit transform (:func:`logit_transform`).
        ignore_index: Target id of the positions without a label.

    Returns:
        ``(nll, argmax)``: float32 and long tensors of shape ``(n,)``.

    Raises:
        ValueError: a target outside ``0..vocab-1`` other than ``ignore_index`` (as :func:`chunked_lm_loss`).
    """
    hidden = hidden.float()
    n = hidden.shape[0]
    vocab_size = getattr(lm_head, "out_features", None)
    _check_labels(targets, vocab_size, ignore_index)
    if not _streamable(lm_head):  # the loss's own chunks, a few positions at a time
        step = max(1, VOCAB_BLOCK_ELEMENTS // max(1, vocab_size or 1))
        parts = [_chunk_nll(hidden[s : s + step], targets[s : s + step], lm_head, ignore_index, logit_scale, logit_softcap)
                 for s in range(0, n, step) or [0]]
        return torch.cat([nll for nll, _ in parts]), torch.cat([logits.argmax(1) for _, logits in parts])
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    scratch = _BlockScratch()
    # PREDICTION_POSITIONS at a time bounds the block logits (and their exponentials) to 2 MiB each
    parts = [_streamed_predictions(hidden[s : s + PREDICTION_POSITIONS], lm_head, safe[s : s + PREDICTION_POSITIONS],
                                   logit_scale, logit_softcap, scratch) for s in range(0, n, PREDICTION_POSITIONS) or [0]]
    return torch.cat([p[0] for p in parts]) * valid, torch.cat([p[1] for p in parts])


def _streamed_predictions(hidden: torch.Tensor, lm_head: nn.Linear, targets: torch.Tensor, scale: float,
                          softcap: float | None, scratch: _BlockScratch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lm_head_predictions` of a frozen ``nn.Linear`` head for a few positions (``targets`` all valid ids)."""
    online = _OnlineLogSumExp(hidden, targets)
    best = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for rows, weight, bias in _weight_blocks(lm_head, hidden.dtype, "forward"):
        logits, _ = _block_logits(hidden, weight, bias, scale, softcap, scratch)
        block_max, block_arg = logits.max(dim=1)
        best = torch.where(block_max > online.running_max, block_arg + rows.start, best)  # the first maximum wins, as argmax
        online.add(logits, rows, block_max, scratch)
    return online.logsumexp() - online.target_logit, best
