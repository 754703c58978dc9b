"""LanguageModelMetrics.update: from logits, or from a streamed head's per-position NLL and predictions; ``labels``
are the batch's unshifted labels either way."""

from __future__ import annotations

import pytest
import torch

from lcsb_lightning.recipes.metrics import LanguageModelMetrics


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "batch-by-position"])
def test_streamed_predictions_give_the_metrics_of_the_logits(flat: bool) -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100  # a prompt
    from_logits, streamed = LanguageModelMetrics(), LanguageModelMetrics()
    from_logits.update(logits, labels)
    shifted = logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(shifted.transpose(1, 2), labels[:, 1:], reduction="none")  # (2, 4)
    predicted = shifted.argmax(-1)
    if flat:
        nll, predicted = nll.reshape(-1), predicted.reshape(-1)
    streamed.update(None, labels, nll=nll, predicted=predicted)
    for key, value in from_logits.compute().items():
        torch.testing.assert_close(streamed.compute()[key], value)


@pytest.mark.parametrize("given", [{}, {"nll": torch.zeros(4)}, {"predicted": torch.zeros(4, dtype=torch.long)}])
def test_update_without_logits_needs_both_nll_and_predicted(given: dict) -> None:
    with pytest.raises(ValueError, match="`logits`, or both `nll` and `predicted`"):
        LanguageModelMetrics().update(None, torch.zeros(1, 5, dtype=torch.long), **given)


@pytest.mark.parametrize(("labels", "nll", "match"), [
    (torch.zeros(2, 5, dtype=torch.long), torch.zeros(10), r"one per shifted position of `labels` \(2 x 4 = 8\); got 10"),
    (torch.zeros(10, dtype=torch.long), torch.zeros(8), r"`labels` \(batch, seq\), not yet shifted; got shape \(10,\)"),
])
def test_labels_of_the_wrong_shape_are_refused(labels: torch.Tensor, nll: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LanguageModelMetrics().update(None, labels, nll=nll, predicted=torch.zeros_like(nll, dtype=torch.long))
