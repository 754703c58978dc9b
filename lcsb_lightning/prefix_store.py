"""What :class:`~lcsb_lightning.prefix_cache.FrozenPrefix` keeps per training example, and when a stored output may
stand in for the frozen blocks.

An example is known by its tokens (a right-padded row by its real tokens, any other by its whole row and mask) and
replays only where a probe of block 0's input (per position: the sum of its hidden state, and its ``position_ids``)
equals the stored one. The real positions of a right-padded row do not depend on the padding after them; whether the
loss reads the padded positions (``labels=input_ids`` with pad = EOS) or not (labels of -100) the store learns from
gradients, which are exactly zero there unless it does. Until a step has shown that nothing reads them, a row is
stored whole and replays only into batches no wider than it was stored from; after, it is stored without its padding
and replays into any width, zeros there, and a loss that reads them after all fails the step in backward.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

from lcsb_lightning.hidden_states import replace_hidden
from lcsb_lightning.rank_zero import rank_zero_warn

Entry = tuple[torch.Tensor, torch.Tensor]  # (block frozen - 1's output for the row, the row's probe), on the host


@dataclass
class CacheStats:
    """Counters of a :class:`~lcsb_lightning.prefix_cache.FrozenPrefix` (training batches only)."""

    batches: int = 0
    hits: int = 0
    seeded: int = 0  # batches started from the outputs stored before the freeze grew
    stored_examples: int = 0
    stored_bytes: int = 0
    dropped_examples: int = 0  # not stored: the cache was full


class Row(NamedTuple):
    """One example of the current batch: its key and, for a right-padded row, its real length."""

    key: bytes
    length: int | None


def batch_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[Row]:
    """The rows of a batch: a right-padded one keyed by its real tokens, any other by its whole row and mask."""
    ids = input_ids.detach().to("cpu")
    mask = attention_mask.detach().to("cpu") if attention_mask is not None else None
    rows = []
    for j in range(ids.shape[0]):
        length = None
        if mask is not None:
            real = int(mask[j].sum())
            length = real if bool(mask[j, :real].all()) and not bool(mask[j, real:].any()) else None
        if length is not None:
            payload = b"r" + ids[j, :length].numpy().tobytes()
        else:  # the whole row and its mask: only the same batch layout hits
            payload = b"f" + ids[j].numpy().tobytes() + (mask[j].numpy().tobytes() if mask is not None else b"")
        rows.append(Row(hashlib.blake2b(payload, digest_size=16).digest(), length))
    return rows


def input_probe(hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """Per position of block 0's input, the sum of its hidden state and its ``position_ids`` (0 without), on the
    host: ``(batch, sequence, 2)``."""
    summed = hidden.detach().float().sum(-1)
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[-1] == summed.shape[-1]:
        positions = positions.expand_as(summed).float()
    else:
        positions = torch.zeros_like(summed)
    return torch.stack((summed, positions), -1).cpu()


def _nbytes(entry: Entry) -> int:
    return sum(t.numel() * t.element_size() for t in entry)


def _hidden(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


class OutputStore:
    """The outputs kept on the host within ``max_bytes``, and whether the loss reads the padded positions.

    Attributes:
        padding_read: Whether the training step's loss reads the frozen blocks' output at padded positions: None until
            a step's gradient has shown it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: dict[bytes, Entry] = {}
        # before the freeze grew: block previous_frozen - 1's outputs, the input the newly frozen blocks start from
        self.previous: dict[bytes, Entry] = {}
        self.previous_frozen = 0
        self.output_kind: tuple[type, tuple[Any, ...]] | None = None  # a block's output type, what follows the hidden
        self.activation_dtype: torch.dtype | None = None
        self.stats = CacheStats()
        self.disabled_reason: str | None = None
        self.padding_read: bool | None = None

    def rebuild_output(self, hidden: torch.Tensor) -> Any:
        assert self.output_kind is not None
        kind, rest = self.output_kind
        return hidden if kind is torch.Tensor else kind((hidden, *rest))

    def remember(self, rows: list[Row], probe: torch.Tensor, output: Any) -> None:
        """Store the rows of block ``frozen - 1``'s ``output`` not yet stored as wide: their real positions once no
        loss reads the padding, else all of them."""
        hidden = _hidden(output)
        rest = () if isinstance(output, torch.Tensor) else tuple(output[1:])
        if any(isinstance(item, torch.Tensor) for item in rest):
            self.disable("a frozen block returns tensors besides its hidden states (attention weights or a KV cache)")
            return
        self.output_kind, self.activation_dtype = (type(output), rest), hidden.dtype
        width = hidden.shape[1]
        for j, row in enumerate(rows):
            kept = row.length if row.length is not None and self.padding_read is False else width
            old = self.entries.get(row.key)
            if (old is not None and old[0].shape[0] >= kept) or (row.length or 0) > width:
                continue  # stored as wide, or the live row is shorter than the batch's mask says
            superseded = self.previous.pop(row.key, None)  # released before its successor is budgeted
            if superseded is not None:
                self.stats.stored_bytes -= _nbytes(superseded)
            entry = (hidden[j, :kept].detach().to("cpu", copy=True), probe[j, :kept].clone())
            freed = _nbytes(old) if old is not None else 0
            if self.stats.stored_bytes - freed + _nbytes(entry) > self.max_bytes:
                self.stats.dropped_examples += 1
                continue
            self.entries[row.key] = entry
            self.stats.stored_examples += old is None
            self.stats.stored_bytes += _nbytes(entry) - freed

    def _replayed(self, row: Row, stored: int, width: int) -> int | None:
        """How many stored positions of a row replay into a batch ``width`` wide (the rest: zeros), or None if the
        row cannot replay there."""
        if row.length is not None and self.padding_read is False:
            return row.length if row.length <= min(stored, width) else None
        narrowest = stored if row.length is None else row.length  # a whole-row key only as wide as stored
        return width if narrowest <= width <= stored else None

    def assemble(self, store: dict[bytes, Entry], rows: list[Row], probe: torch.Tensor,
                 device: torch.device) -> torch.Tensor | None:
        """The stored output of every row of the batch at the live width; None if one is missing, cannot replay at
        this width, or has another probe (another input reaches block 0)."""
        entries = [store.get(row.key) for row in rows]
        if not entries or any(entry is None for entry in entries):
            return None
        width, parts = probe.shape[1], []
        for row, (value, stored), live in zip(rows, entries, probe):  # type: ignore[misc]
            count = self._replayed(row, value.shape[0], width)
            if count is None or not torch.equal(stored[:count], live[:count]):
                return None
            parts.append(F.pad(value[:count], (0, 0, 0, width - count)))
        return torch.stack(parts).to(device=device, dtype=self.activation_dtype)

    def _padded(self, rows: list[Row], hidden: torch.Tensor, replayed: bool) -> torch.Tensor | None:
        """The padded positions while the loss may read them, or a replay put zeros there; None: nothing to watch."""
        if self.max_bytes == 0 or self.padding_read or (self.padding_read is False and not replayed):
            return None
        width = hidden.shape[1]
        lengths = [width if row.length is None else min(row.length, width) for row in rows]
        if all(length == width for length in lengths):
            return None
        return torch.arange(width, device=hidden.device) >= torch.tensor(lengths, device=hidden.device).unsqueeze(1)

    def watch_top(self, rows: list[Row], output: Any, replayed: bool) -> Any:
        """:meth:`check_padding` on the top block's hidden-state gradient (the head works position by position)."""
        hidden = _hidden(output)
        padded = self._padded(rows, hidden, replayed) if hidden.requires_grad else None
        if padded is not None:
            zeros_there = self.padding_read is False
            hidden.register_hook(lambda grad: self.check_padding(grad, padded, zeros_there))
        return output

    def watch_leaf(self, rows: list[Row], output: Any, replayed: bool) -> Any:
        """Block ``frozen - 1``'s output as a leaf whose gradient :meth:`check_padding` reads (a zero there also shows
        that nothing the loss reads attends to the padded positions)."""
        padded = self._padded(rows, _hidden(output), replayed)
        if padded is None:
            return output
        zeros_there = self.padding_read is False

        def check(tensor: torch.Tensor) -> None:
            grad, tensor.grad = tensor.grad, None
            assert grad is not None
            self.check_padding(grad, padded, zeros_there)

        def as_leaf(hidden: torch.Tensor) -> torch.Tensor:
            watched = hidden.detach().requires_grad_()
            watched.register_post_accumulate_grad_hook(check)
            return watched

        return replace_hidden(output, as_leaf)

    def check_padding(self, grad: torch.Tensor, padded: torch.Tensor, zeros_there: bool) -> None:
        """Learn from a block output's gradient whether the loss reads its ``padded`` positions: exact zeros there and
        not everywhere show that it does not; anything else there that it does, which fails a step whose replay put
        zeros there (``zeros_there``) before an optimizer applies it."""
        nonzero, where = grad != 0, padded.unsqueeze(-1)
        read, reached = torch.stack(((nonzero & where).any(), (nonzero & ~where).any())).tolist()  # one sync
        if read:
            self.padding_read = True
        elif reached and self.padding_read is None:
            self.padding_read = False
        if read and zeros_there:
            raise RuntimeError(
                "FrozenPrefix: the loss reads the frozen blocks' output at padded positions, which earlier steps did "
                "not: this step replayed stored rows into a wider batch, with zeros there. Label the padded positions "
                "-100 at every step, or use ProgressiveFreezing(cache=False)."
            )

    def disable(self, reason: str) -> None:
        """Store nothing from now on, warning once with ``reason``; the frozen blocks still run without a graph."""
        if self.disabled_reason is None and self.max_bytes > 0:
            rank_zero_warn(f"FrozenPrefix stores nothing: {reason}; the frozen blocks still run without a graph.")
        self.disabled_reason = reason
        self.max_bytes = 0
        self.clear()

    def clear(self) -> None:
        """Forget every stored output (they were computed with weights that have changed since)."""
        self.entries, self.previous, self.previous_frozen = {}, {}, 0
        self.stats.stored_examples = self.stats.stored_bytes = 0

    def grow(self, frozen: int) -> None:
        """The freeze grows from ``frozen`` blocks: the outputs stored so far become where the next ones start."""
        previous = self.entries
        self.clear()
        self.previous, self.previous_frozen = previous, frozen
        self.stats.stored_bytes = sum(_nbytes(entry) for entry in previous.values())
