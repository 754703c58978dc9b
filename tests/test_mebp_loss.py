"""chunked_lm_loss equals the full cross-entropy, also through a compressed LM head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lcsb_lightning.mebp import chunked_lm_loss
from lcsb_lightning.mebp.layer import CompressedLinear


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("compressed", [False, True])
def test_chunked_loss_and_gradient_equal_full_loss(chunk_size: int, compressed: bool) -> None:
    torch.manual_seed(0)
    head: nn.Module = nn.Linear(32, 50, bias=False).requires_grad_(False)
    if compressed:
        head = CompressedLinear.from_linear(head, "int4", 32)
        head.max_chunk_elements = 32 * 16  # also decompress the head in row chunks
    hidden = torch.randn(2, 9, 32, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, 3] = -100
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    logits = head(reference_hidden)
    reference = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    loss = chunked_lm_loss(hidden, head, labels, chunk_size=chunk_size)
    torch.testing.assert_close(loss, reference)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(hidden.grad, reference_hidden.grad)


@pytest.mark.parametrize(
    ("hidden_shape", "labels_shape", "chunk_size", "match"),
    [
        ((2, 4, 8), (2, 4), 0, r"`chunk_size` must be a positive integer, got 0"),
        ((2, 4, 8), (2, 5), 4, r"Expected `hidden_states` \(batch, seq, hidden\) and `labels` \(batch, seq\)"),
    ],
)
def test_chunked_loss_errors(hidden_shape: tuple, labels_shape: tuple, chunk_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        chunked_lm_loss(torch.randn(hidden_shape), nn.Linear(8, 10), torch.zeros(labels_shape, dtype=torch.long), chunk_size)
