"""What :class:`~lcsb_lightning.prefix_cache.FrozenPrefix` keeps per training example, and when a stored output can
stand in for the frozen blocks.

**Keys and probes.** An example is known by its tokens: a right-padded row (``attention_mask`` ones, then zeros) by its
real tokens, any other row by its whole row and mask. The tokens name the example, what block 0 receives decides: each
stored output keeps a probe of block 0's input (per position, the sum of its hidden state and its ``position_ids``),
and a row replays only where the live probe equals the stored one.

**Padding.** Under a causal or masked attention the real positions of a right-padded row do not depend on the padding
after them, so the frozen blocks' output there is the example's, whatever the batch's width. The output *at* the
padded positions is another matter: the frozen blocks compute values there (a pad token attending to the real ones),
and a loss that reads them (``labels=input_ids`` with pad = EOS) needs exactly those, while one that does not (labels
of -100 there) gets nothing from them: a masked attention gives them a zero weight, the loss a zero gradient. Which
of the two a training step does, the store learns from gradients: the top block's output's (the head works position
by position, so its gradient at a padded position is exactly zero unless the loss reads it) and, on a step whose
backward reaches it, the last frozen block's output's (a zero there also shows that nothing the loss reads attends to
the padding). Until a step has shown it, and for good once one shows that the loss reads them, a row is stored whole,
its padding included, and replays only into batches no wider than the one it was stored from. Once a step has shown
that nothing reads them (exact zeros at the padded positions, not everywhere), a row is stored without its padding and
replays into a batch of any width, with zeros at its padded positions; each such replay is checked the same way, and
a loss that reads them after all fails the step in backward, before an optimizer applies it (``RuntimeError``).

A replay is bit for bit what the frozen blocks computed for the example; the frozen blocks themselves round the real
positions differently at different batch widths (a reduction over the keys of another length: about 1e-8 in float32),
so a replay into a batch of another width equals the live computation to that rounding.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

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


class Row:
    """One example of the current batch: its key and, for a right-padded row, its real length."""

    __slots__ = ("key", "length")

    def __init__(self, key: bytes, length: int | None) -> None:
        self.key, self.length = key, length


def batch_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[Row]:
    """The rows of a batch: a right-padded one keyed by its real tokens, any other by its whole row and mask."""
    ids = input_ids.detach().to("cpu")
    mask = attention_mask.detach().to("cpu") if attention_mask is not None else None
    rows = []
    for j in range(ids.shape[0]):
        length = None
        if mask is not None:
            real = int(mask[j].sum())
            right_padded = bool(mask[j, :real].all()) and not bool(mask[j, real:].any())
            length = real if right_padded else None
        if length is not None:
            payload = b"r" + ids[j, :length].numpy().tobytes()
        else:  # the whole row, its mask and its length: only the same batch layout hits
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


def padding_mask(rows: list[Row], width: int, device: torch.device) -> torch.Tensor | None:
    """``(batch, width)``, True at the padded positions of the right-padded rows; None if there are none."""
    lengths = [width if row.length is None else min(row.length, width) for row in rows]
    if all(length == width for length in lengths):
        return None
    return torch.arange(width, device=device) >= torch.tensor(lengths, device=device).unsqueeze(1)


def _nbytes(entry: Entry) -> int:
    return sum(t.numel() * t.element_size() for t in entry)


class OutputStore:
    """The outputs kept on the host, within the budget, how one becomes a block's output again, and whether the loss
    reads the padded positions (see the module docstring).

    Attributes:
        padding_read: Whether the training step's loss reads the frozen blocks' output at padded positions: None until
            a step's gradient has shown it.
    """

    def __init__(self, max_bytes: int, dtype: torch.dtype | None) -> None:
        self.max_bytes, self.dtype = max_bytes, dtype
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

    def _kept(self, row: Row, width: int) -> int:
        """How many positions of a row of a batch ``width`` wide to store: the real ones once no loss reads the
        padding, else all of them."""
        return row.length if row.length is not None and self.padding_read is False else width

    def remember(self, rows: list[Row], probe: torch.Tensor, output: Any) -> None:
        """Store the rows of block ``frozen - 1``'s ``output`` that are not stored as wide (see :meth:`_kept`)."""
        hidden = output if isinstance(output, torch.Tensor) else output[0]
        rest = () if isinstance(output, torch.Tensor) else tuple(output[1:])
        if any(isinstance(item, torch.Tensor) for item in rest):
            self.disable("a frozen block returns tensors besides its hidden states (attention weights or a KV cache)")
            return
        self.output_kind, self.activation_dtype = (type(output), rest), hidden.dtype
        width = hidden.shape[1]
        for j, row in enumerate(rows):
            kept = self._kept(row, width)
            old = self.entries.get(row.key)
            if (old is not None and old[0].shape[0] >= kept) or (row.length or 0) > width:
                continue  # stored as wide, or the live row is shorter than the batch's mask says
            superseded = self.previous.pop(row.key, None)  # released before its successor is budgeted
            if superseded is not None:
                self.stats.stored_bytes -= _nbytes(superseded)
            value = hidden[j, :kept].detach().to("cpu", self.dtype or hidden.dtype, copy=True)
            entry = (value, probe[j, :kept].clone())
            freed = _nbytes(old) if old is not None else 0
            if self.stats.stored_bytes - freed + _nbytes(entry) > self.max_bytes:
                self.stats.dropped_examples += 1
                continue
            self.entries[row.key] = entry
            self.stats.stored_examples += old is None
            self.stats.stored_bytes += _nbytes(entry) - freed

    def _replayed(self, row: Row, stored: int, width: int) -> int | None:
        """How many stored positions of a row replay into a batch ``width`` wide (the rest are padding that nothing
        reads: zeros), or None if the row cannot replay there."""
        if row.length is not None and self.padding_read is False:
            return row.length if row.length <= min(stored, width) else None
        narrowest = stored if row.length is None else row.length  # a whole-row key only as wide as stored
        return width if narrowest <= width <= stored else None

    def assemble(self, store: dict[bytes, Entry], rows: list[Row], probe: torch.Tensor,
                 device: torch.device) -> torch.Tensor | None:
        """The stored output of every row of the batch at the live width; None if one is missing or cannot replay at
        this width, or if its stored probe is not the live one (another input reaches block 0)."""
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

    def padding_to_watch(self, rows: list[Row], hidden: torch.Tensor, replayed: bool) -> torch.Tensor | None:
        """The padded positions of ``hidden``, a block's output in a named forward, to watch (see
        :meth:`check_padding`): until a step has shown whether the loss reads them, and where a replay put zeros there
        (``replayed``); None: nothing to watch."""
        if self.max_bytes == 0 or self.padding_read or (self.padding_read is False and not replayed):
            return None
        return padding_mask(rows, hidden.shape[1], hidden.device)

    def check_padding(self, grad: torch.Tensor, padded: torch.Tensor, zeros_there: bool) -> None:
        """Learn from the gradient of a block's output whether the loss reads its ``padded`` positions: exact zeros
        there and not everywhere show that it does not; anything else there, that it does, which fails a step whose
        replay put zeros there (``zeros_there``) before an optimizer applies it."""
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

    def watch_padding(self, hidden: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
        """``hidden``, block ``frozen - 1``'s output, as a leaf whose gradient :meth:`check_padding` reads (a zero
        there also shows that nothing the loss reads attends to the padding)."""
        zeros_there = self.padding_read is False
        leaf = hidden.detach().requires_grad_()

        def check(tensor: torch.Tensor) -> None:
            grad, tensor.grad = tensor.grad, None
            assert grad is not None
            self.check_padding(grad, padded, zeros_there)

        leaf.register_post_accumulate_grad_hook(check)
        return leaf

    def watch_top(self, hidden: torch.Tensor, padded: torch.Tensor) -> None:
        """Have :meth:`check_padding` read the gradient of ``hidden``, the top block's output: what the loss reads
        (the head works position by position), and there whenever a block above the frozen ones trains."""
        zeros_there = self.padding_read is False
        hidden.register_hook(lambda grad: self.check_padding(grad, padded, zeros_there))

    def disable(self, reason: str) -> None:
        if self.disabled_reason is None and self.max_bytes > 0:
            rank_zero_warn(f"FrozenPrefix stores nothing: {reason}; the frozen blocks still run without a graph.")
        self.disabled_reason = reason
        self.max_bytes = 0
        self.clear()

    def clear(self) -> None:
        self.entries, self.previous, self.previous_frozen = {}, {}, 0
        self.stats.stored_examples = self.stats.stored_bytes = 0

    def grow(self, frozen: int) -> None:
        """The freeze grows from ``frozen`` blocks: the outputs stored so far become where the next ones start."""
        previous = self.entries
        self.clear()
        self.previous, self.previous_frozen = previous, frozen
        self.stats.stored_bytes = sum(_nbytes(entry) for entry in previous.values())
