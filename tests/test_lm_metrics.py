"""LanguageModelMetrics.update: from logits, or from a streamed head's per-position NLL and predictions."""

from __future__ import annotations

import pytest
import torch

from lcsb_lightning.recipes.metrics import LanguageModelMetrics


def test_streamed_predictions_give_the_metrics_of_the_logits() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    from_logits, streamed = LanguageModelMetrics(), LanguageModelMetrics()
    from_logits.update(logits, labels)
    shifted, target = logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1)
    nll = torch.nn.functional.cross_entropy(shifted, target, reduction="none")
    streamed.update(None, target, nll=nll, predicted=shifted.argmax(-1))
    for key, value in from_logits.compute().items():
        torch.testing.assert_close(streamed.compute()[key], value)


@pytest.mark.parametrize("given", [{}, {"nll": torch.zeros(3)}, {"predicted": torch.zeros(3, dtype=torch.long)}])
def test_update_without_logits_needs_both_nll_and_predicted(given: dict) -> None:
    with pytest.raises(ValueError, match="`logits`, or both `nll` and `predicted`"):
        LanguageModelMetrics().update(None, torch.zeros(3, dtype=torch.long), **given)
