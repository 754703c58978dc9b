"""chunked_lm_loss equals the full cross-entropy, also through a compressed LM head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lcsb_lightning.mebp import chunked_lm_loss
from lcsb_lightning.mebp.layer import CompressedLinear


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("head_kind", ["frozen", "compressed", "trainable", "callable"])
def test_chunked_loss_and_gradient_equal_full_loss(chunk_size: int, head_kind: str) -> None:
    torch.manual_seed(0)
    head: nn.Module = nn.Linear(32, 50, bias=True).requires_grad_(head_kind == "trainable")
    if head_kind == "compressed":
        head = CompressedLinear.from_linear(head, "int4", 32)
        head.max_chunk_elements = 32 * 16  # stream the vocabulary in blocks of 16 rows
    elif head_kind == "callable":
        linear = head
        head = lambda h: linear(h)  # noqa: E731  (any callable: checkpointed per chunk)
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
    if head_kind == "trainable":
        assert head.weight.grad is not None


def test_streamed_head_decompresses_once_per_chunk_and_not_in_backward() -> None:
    head = CompressedLinear.from_linear(nn.Linear(32, 64), "int4", 32)
    head.max_chunk_elements = 32 * 16  # four vocabulary blocks
    hidden = torch.randn(1, 9, 32, requires_grad=True)
    chunked_lm_loss(hidden, head, torch.randint(0, 64, (1, 9)), chunk_size=16).backward()
    assert head.decompress_count == {"forward": 1, "backward": 0}
    with torch.no_grad():  # evaluation: 8 shifted tokens in 2 chunks, one decompression each
        chunked_lm_loss(hidden, head, torch.randint(0, 64, (1, 9)), chunk_size=4)
    assert head.decompress_count == {"forward": 3, "backward": 0}


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
