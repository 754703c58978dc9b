"""torchmetrics metrics of the recipes: LM loss/perplexity/next-token accuracy and final-number exact match."""

from __future__ import annotations

import math

import torch
from torchmetrics import Metric

from lcsb_lightning.recipes.batching import IGNORE


class LanguageModelMetrics(Metric):
    """Token-weighted loss, perplexity and next-token accuracy over an evaluation epoch (MeBP's metrics); positions
    whose shifted label is ``-100`` (prompt or padding) are ignored."""

    full_state_update = False
    higher_is_better = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("nll", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(  # type: ignore[override]
        self, logits: torch.Tensor | None, labels: torch.Tensor, *, nll: torch.Tensor | None = None,
        predicted: torch.Tensor | None = None,
    ) -> None:
        """Accumulate one batch.

        Args:
            logits: ``(batch, seq, vocab)`` logits, or None with ``nll`` and ``predicted``.
            labels: ``(batch, seq)`` labels, not yet shifted (as the model takes them), in either case.
            nll, predicted: Per shifted position (position ``t`` predicts ``labels[:, t + 1]``), the NLL and the
                predicted token, ``(batch, seq - 1)`` or flattened: what a streamed LM head gives
                (``lcsb_lightning.mebp.loss.lm_head_predictions``), no logits needed.
        """
        if labels.dim() != 2:
            raise ValueError(f"LanguageModelMetrics.update needs `labels` (batch, seq), not yet shifted; got shape "
                             f"{tuple(labels.shape)}.")
        target = labels[:, 1:].reshape(-1)
        if nll is None or predicted is None:
            if logits is None:
                raise ValueError("LanguageModelMetrics.update needs `logits`, or both `nll` and `predicted` (a streamed "
                                 f"head's); got nll={'a tensor' if nll is not None else None}, "
                                 f"predicted={'a tensor' if predicted is not None else None}.")
            shifted = logits[:, :-1].float().reshape(-1, logits.size(-1))
            nll = torch.nn.functional.cross_entropy(shifted, target, ignore_index=IGNORE, reduction="none")
            predicted = shifted.argmax(-1)
        if nll.numel() != target.numel() or predicted.numel() != target.numel():
            raise ValueError(f"LanguageModelMetrics.update: `nll` and `predicted` need one per shifted position of "
                             f"`labels` ({labels.shape[0]} x {labels.shape[1] - 1} = {target.numel()}); got "
                             f"{nll.numel()} and {predicted.numel()}.")
        mask = target != IGNORE
        self.nll = self.nll + (nll.reshape(-1) * mask).sum().double()
        self.correct = self.correct + ((predicted.reshape(-1) == target) & mask).sum()
        self.tokens = self.tokens + mask.sum()

    def compute(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Return ``loss`` (mean NLL per token), ``ppl`` and ``token_acc``."""
        n = self.tokens.clamp(min=1)
        loss = (self.nll / n).float()
        return {
            "loss": loss,
            "ppl": torch.exp(loss.clamp(max=math.log(1e30))),
            "token_acc": (self.correct.double() / n).float(),
        }


class ExactMatch(Metric):
    """Share of predictions equal to their reference (strings; ``None`` never matches)."""

    full_state_update = False
    higher_is_better = True

    def __init__(self) -> None:
        super().__init__()
        self.add_state("hits", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: list[str | None], targets: list[str | None]) -> None:  # type: ignore[override]
        """Count matches of one batch."""
        self.hits = self.hits + sum(int(p is not None and p == t) for p, t in zip(preds, targets))
        self.total = self.total + len(targets)

    def compute(self) -> torch.Tensor:  # type: ignore[override]
        """Return the exact-match rate."""
        return self.hits.float() / self.total.clamp(min=1).float()
