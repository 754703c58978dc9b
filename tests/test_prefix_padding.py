"""The frozen-prefix store under dynamic padding: rows stored once replay into batches of any width when the loss reads
no padded position, and only into batches no wider than they were stored from when it does."""

from __future__ import annotations

import pytest
import torch
from _recipes_utils import one_thread  # noqa: F401  (autouse: tensors this small run fastest on one thread)
from torch import nn
from torch.nn import functional as F

from lcsb_lightning.prefix_cache import FrozenPrefix

VOCAB, WIDTH = 64, 8


class CausalBlock(nn.Module):
    """A residual block in which position ``p`` sees positions ``0..p`` (a running mean, as a causal attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        seen = hidden.cumsum(1) / torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
        return hidden + torch.tanh(self.fc(seen))


class CausalLM(nn.Module):
    """Embedding, causal blocks (the lowest 2 frozen) and a head; a pad token's embedding is not zero."""

    def __init__(self, num_blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH).requires_grad_(False)
        self.blocks = nn.ModuleList(CausalBlock() for _ in range(num_blocks))
        self.head = nn.Linear(WIDTH, VOCAB)
        for block in self.blocks[:2]:
            block.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def _loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, padding_in_the_loss: bool) -> torch.Tensor:
    labels = ids if padding_in_the_loss else ids.masked_fill(mask == 0, -100)  # pad = EOS: padded labels count
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


def _data_set(examples: int, shortest: int, longest: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (examples,), generator=g)
    return [torch.randint(1, VOCAB, (int(n),), generator=g) for n in lengths]


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded to the longest row (pad id 0), as a dynamic-padding collate does."""
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, row in enumerate(rows):
        ids[j, : len(row)], mask[j, : len(row)] = row, 1
    return ids, mask


def simulate(epochs: int = 4, examples: int = 512, shortest: int = 32, longest: int = 256, batch: int = 8,
             cache: bool = True, padding_in_the_loss: bool = False) -> tuple[list[float], list[float], FrozenPrefix]:
    """A fit of ``epochs`` shuffled epochs with the two lowest blocks frozen from the start: the store's hit rate of
    each epoch, the losses, and the (removed) prefix. Epoch 1 computes and stores every example; the later ones can
    replay them."""
    model = CausalLM()
    prefix = FrozenPrefix(model.blocks, max_bytes=2**31 if cache else 0)
    prefix.freeze(2)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    data, order = _data_set(examples, shortest, longest), torch.Generator().manual_seed(1)
    rates, losses = [], []
    for _ in range(epochs):
        hits = prefix.stats.hits
        permutation = torch.randperm(examples, generator=order).tolist()
        for start in range(0, examples, batch):
            ids, mask = _padded([data[i] for i in permutation[start : start + batch]])
            prefix.set_batch(ids, mask)
            loss = _loss(model(ids), ids, mask, padding_in_the_loss)
            loss.backward()
            prefix.end_batch()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        rates.append((prefix.stats.hits - hits) / (examples // batch))
    prefix.remove()
    return rates, losses, prefix


def test_shuffled_dynamically_padded_batches_hit_once_every_example_is_stored() -> None:
    """512 examples of 32 to 256 tokens in shuffled batches of 8, padded to each batch's longest, the loss on the real
    tokens: from epoch 2 on every batch replays (0.8.0 replayed only into batches no wider than the stored rows:
    0.11 / 0.25 / 0.38 here), and the losses are, bit for bit, those of the frozen blocks run at every step."""
    rates, losses, prefix = simulate()
    assert rates[0] == 0.0 and all(rate >= 0.9 for rate in rates[1:]), rates
    assert prefix.padding_read is False
    _, plain, _ = simulate(cache=False)
    assert losses == plain


def test_a_loss_that_reads_the_padding_gets_what_the_frozen_blocks_compute_there() -> None:
    """``labels=input_ids`` with pad = EOS: zeros at the padded positions would change the loss, so a row replays only
    into batches no wider than it was stored from (fewer hits), and the losses stay those of the live blocks."""
    rates, losses, prefix = simulate(epochs=2, examples=128, padding_in_the_loss=True)
    assert prefix.padding_read is True and 0.0 < rates[1] < 1.0, rates
    _, plain, _ = simulate(epochs=2, examples=128, cache=False, padding_in_the_loss=True)
    assert losses == plain


def _step(model: CausalLM, prefix: FrozenPrefix | None, rows: list[torch.Tensor], width: int,
          padding_in_the_loss: bool = False) -> torch.Tensor:
    """One training step's forward and backward on ``rows`` padded to ``width``; its loss."""
    ids, mask = _padded(rows)
    ids, mask = F.pad(ids, (0, width - ids.shape[1])), F.pad(mask, (0, width - mask.shape[1]))
    if prefix is not None:
        prefix.set_batch(ids, mask)
    try:
        loss = _loss(model(ids), ids, mask, padding_in_the_loss)
        loss.backward()
    finally:
        if prefix is not None:
            prefix.end_batch()
    return loss.detach()


def test_a_loss_that_starts_reading_the_padding_fails_the_step_it_replayed_zeros_into() -> None:
    """Once a step showed that nothing reads the padded positions, rows replay with zeros there; a later loss that
    reads them fails in backward, before an optimizer could apply the step, and from then on rows are kept whole."""
    model = CausalLM()
    prefix = FrozenPrefix(model.blocks)
    prefix.freeze(2)
    rows = _data_set(2, 5, 9)
    _step(model, prefix, rows, width=10)
    assert prefix.padding_read is False
    with pytest.raises(RuntimeError, match="the loss reads the frozen blocks' output at padded positions"):
        _step(model, prefix, rows, width=12, padding_in_the_loss=True)
    assert prefix.padding_read is True and prefix.stats.hits == 1
    model.zero_grad()
    _step(model, prefix, rows, width=12, padding_in_the_loss=True)  # computed, and stored whole
    _step(model, prefix, rows, width=11, padding_in_the_loss=True)
    _step(model, prefix, rows, width=14, padding_in_the_loss=True)  # wider than stored: computed
    assert prefix.stats.hits == 2
    prefix.remove()


def test_a_growing_freeze_starts_from_rows_stored_without_their_padding() -> None:
    """After a step showed the padding unread, the outputs stored before the freeze grew seed the newly frozen blocks
    at any width (zeros at the padded positions), and their outputs replay at any width: the losses of the live
    blocks, bit for bit."""
    model, reference = CausalLM(), CausalLM()
    prefix = FrozenPrefix(model.blocks)
    rows = _data_set(3, 4, 9)
    prefix.freeze(1)
    losses = [_step(model, prefix, rows, width=10)]
    prefix.freeze(2)
    losses += [_step(model, prefix, rows[::-1], width=13), _step(model, prefix, rows, width=15)]
    assert prefix.padding_read is False and (prefix.stats.seeded, prefix.stats.hits) == (1, 1)
    expected = [_step(reference, None, r, width=w) for r, w in ((rows, 10), (rows[::-1], 13), (rows, 15))]
    assert losses == expected
    prefix.remove()


def test_the_top_block_shows_the_padding_unread_where_the_backward_stops_above_the_frozen_ones() -> None:
    """LCSB trains the top block alone (``all_reached``): no gradient reaches the frozen blocks' output, the top
    block's shows that the loss reads no padded position, and the next, wider batch replays, bit for bit."""
    from lcsb_lightning import LCSBController
    from lcsb_lightning.policies import TopOnlyPolicy

    model, reference = CausalLM(num_blocks=4), CausalLM(num_blocks=4)
    prefix = FrozenPrefix(model.blocks)
    prefix.freeze(2)
    controller = LCSBController(model, TopOnlyPolicy(layers_per_step=1), blocks=lambda m: m.blocks)
    rows = _data_set(3, 4, 9)
    losses = []
    for step, width in enumerate((10, 13)):
        controller.begin_step(step)
        losses.append(_step(model, prefix, rows, width))
        assert not model.blocks[2].fc.weight.grad.any()  # cut: LCSB's exact zero, the backward stopped above it
    assert prefix.padding_read is False and prefix.stats.hits == 1
    assert losses == [_step(reference, None, rows, width) for width in (10, 13)]
    controller.release()
    prefix.remove()
