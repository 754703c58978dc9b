"""Plain-torch core of progressive freezing: the lowest blocks stop training and their output is reused.

Once the ``k`` lowest blocks (and whatever lies below them, an input embedding) no longer change, the
hidden states they hand block ``k`` depend on the example alone. :class:`FrozenPrefix` then runs them
without a graph (their backward is gone), stores block ``k - 1``'s output per training example the first
time it computes it, and from then on skips their forward too for every batch whose examples are all
stored: block ``k`` receives the stored hidden states, bit for bit what the frozen blocks would compute.
That is the AutoFreeze / Egeria idea for multi-epoch fine-tuning: the first epoch after a freeze pays
the frozen blocks' forward, the later ones pay nothing for them.

An example is known by its tokens: :meth:`FrozenPrefix.set_batch` hashes each row of ``input_ids``
before the forward pass. A right-padded row (``attention_mask`` ones, then zeros) is known by its real tokens
and stored whole, its padding included, so a loss on the padded positions (``labels=input_ids`` with pad =
EOS) gets what the frozen blocks compute there, never zeros. It replays in any batch no wider than the one
it was stored from (under a masked attention no position depends on the padding after it), and a wider batch
computes it again and stores it wider: with dynamic padding an example hits once seen in its widest batch.
The tokens name the example, what block 0 receives decides: each stored output keeps a probe of block 0's
input (per position, the sum of its hidden state and its ``position_ids``), and a batch replays only if
the live probe equals the stored one at every position, so a ``training_step`` that masks or perturbs the
inputs, shifts the positions or truncates the rows recomputes. Only the first forward pass after
:meth:`~FrozenPrefix.set_batch` replays or stores; a second one in the same step, evaluation (a block in
``eval()`` mode) and a forward pass with no batch set run the blocks as they are.

The stored outputs live in host memory (the accelerator's is for the activations); a replay copies the
batch's rows back. The prefix must really be frozen: the caller turns ``requires_grad`` off for its
parameters and keeps the optimizer from moving them (:class:`~lcsb_lightning.freezing.ProgressiveFreezing`
does both). A dropout active inside it (a ``p > 0`` dropout module or an attention dropout in training
mode: peft's ``lora_dropout``, a residual dropout) would make a stored output one sample of it: a freeze
that finds one stores nothing, with a warning.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lcsb_lightning.forward_wrap import ForwardStack, get_wrapper, install_wrapper, remove_wrapper
from lcsb_lightning.hidden_states import hidden_input, replace_hidden, trainable_leaves, uses_reentrant_checkpoint
from lcsb_lightning.rank_zero import rank_zero_warn

#: Name of the frozen-prefix wrapper in a block's forward stack.
FROZEN_WRAPPER = "lcsb_frozen_prefix"
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclass
class CacheStats:
    """Counters of a :class:`FrozenPrefix` (training batches only)."""

    batches: int = 0
    hits: int = 0
    seeded: int = 0  # batches started from the outputs stored before the freeze grew
    stored_examples: int = 0
    stored_bytes: int = 0
    dropped_examples: int = 0  # not stored: the cache was full


class _Row:
    """One example of the current batch: its key and, for a right-padded row, its real length."""

    __slots__ = ("key", "length")

    def __init__(self, key: bytes, length: int | None) -> None:
        self.key, self.length = key, length


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[_Row]:
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
        rows.append(_Row(hashlib.blake2b(payload, digest_size=16).digest(), length))
    return rows


def _probe(hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """Per position of block 0's input, the sum of its hidden state and its ``position_ids`` (0 without), on the
    host: ``(batch, sequence, 2)``."""
    summed = hidden.detach().float().sum(-1)
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[-1] == summed.shape[-1]:
        positions = positions.expand_as(summed).float()
    else:
        positions = torch.zeros_like(summed)
    return torch.stack((summed, positions), -1).cpu()


def _active_dropout(blocks: Sequence[nn.Module]) -> str | None:
    """The first dropout of ``blocks`` that is active (training mode, ``p > 0``), described; None if there is none."""
    for index, block in enumerate(blocks):
        for name, module in block.named_modules():
            p = module.p if isinstance(module, _DROPOUTS) else getattr(module, "attention_dropout", 0.0)
            if module.training and isinstance(p, (int, float)) and p > 0:
                return f"block {index}'s {name or 'itself'}: {type(module).__name__}, p={p}"
    return None


def _nbytes(entry: tuple[torch.Tensor, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in entry)


class _Store:
    """The outputs kept on the host, within the budget, and how one becomes a block's output again."""

    def __init__(self, max_bytes: int, dtype: torch.dtype | None) -> None:
        self.max_bytes, self.dtype = max_bytes, dtype
        self.entries: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (whole row's output, probe)
        # before the freeze grew: block previous_frozen - 1's outputs, the input the newly frozen blocks start from
        self.previous: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.previous_frozen = 0
        self.output_kind: tuple[type, tuple[Any, ...]] | None = None  # a block's output type, what follows the hidden
        self.activation_dtype: torch.dtype | None = None
        self.stats = CacheStats()
        self.disabled_reason: str | None = None

    def rebuild_output(self, hidden: torch.Tensor) -> Any:
        assert self.output_kind is not None
        kind, rest = self.output_kind
        return hidden if kind is torch.Tensor else kind((hidden, *rest))

    def remember(self, rows: list[_Row], probe: torch.Tensor, output: Any) -> None:
        """Store the rows of block ``frozen - 1``'s ``output``, padding included, that are not stored as wide."""
        hidden = output if isinstance(output, torch.Tensor) else output[0]
        rest = () if isinstance(output, torch.Tensor) else tuple(output[1:])
        if any(isinstance(item, torch.Tensor) for item in rest):
            self.disable("a frozen block returns tensors besides its hidden states (attention weights or a KV cache)")
            return
        self.output_kind, self.activation_dtype = (type(output), rest), hidden.dtype
        width = hidden.shape[1]
        for j, row in enumerate(rows):
            old = self.entries.get(row.key)
            if (old is not None and old[0].shape[0] >= width) or (row.length or 0) > width:
                continue  # stored as wide, or the live row is shorter than the batch's mask says
            superseded = self.previous.pop(row.key, None)  # released before its successor is budgeted
            if superseded is not None:
                self.stats.stored_bytes -= _nbytes(superseded)
            entry = (hidden[j].detach().to("cpu", self.dtype or hidden.dtype, copy=True), probe[j].clone())
            freed = _nbytes(old) if old is not None else 0
            if self.stats.stored_bytes - freed + _nbytes(entry) > self.max_bytes:
                self.stats.dropped_examples += 1
                continue
            self.entries[row.key] = entry
            self.stats.stored_examples += old is None
            self.stats.stored_bytes += _nbytes(entry) - freed

    def assemble(self, store: dict[bytes, tuple[torch.Tensor, torch.Tensor]], rows: list[_Row],
                 probe: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """The stored output of every row of the batch, cut to the live width; None if one is missing or
        narrower than the batch, or if its stored probe is not the live one (another input reaches block 0)."""
        entries = [store.get(row.key) for row in rows]
        if not entries or any(entry is None for entry in entries):
            return None
        width = probe.shape[1]
        for row, (value, stored), live in zip(rows, entries, probe):  # type: ignore[misc]
            # a right-padded row hits in any batch as wide as its real part, a whole-row key only as wide as stored
            narrowest = value.shape[0] if row.length is None else row.length
            if not narrowest <= width <= value.shape[0] or not torch.equal(stored[:width], live):
                return None
        out = torch.stack([value[:width] for value, _ in entries])  # type: ignore[index]
        return out.to(device=device, dtype=self.activation_dtype)

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


class _Batch:
    """The current training batch: whether its first forward replays the stored outputs, is seeded by the
    previous ones or computes (and stores)."""

    def __init__(self, rows: list[_Row]) -> None:
        self.rows = rows
        self.forwards = self.size = 0  # block 0's forwards since set_batch (the first replays or stores), its rows
        self.probe: torch.Tensor | None = None  # the first forward's probe of block 0's input (see _probe)
        self.hit: torch.Tensor | None = None  # block frozen - 1's output for the whole batch, when all rows are stored
        self.seed: torch.Tensor | None = None  # the previous outputs of the whole batch (no hit, all rows in previous)

    def named(self) -> bool:
        """Whether the running forward pass is the one :meth:`FrozenPrefix.set_batch` named the rows of: the first
        since, and as many rows as named."""
        return self.forwards == 1 and self.size == len(self.rows)

    def start_forward(self, hidden: torch.Tensor, kwargs: dict[str, Any], store: _Store) -> None:
        """Block 0 starts a forward pass on ``hidden``: decide, for the named one, whether it replays."""
        self.forwards, self.size = self.forwards + 1, hidden.shape[0]
        if not self.named():
            return
        store.stats.batches += 1
        if store.max_bytes > 0:
            self.probe = _probe(hidden, kwargs)
            self.hit = store.assemble(store.entries, self.rows, self.probe, hidden.device)
            self.seed = None if self.hit is not None else store.assemble(store.previous, self.rows, self.probe,
                                                                         hidden.device)
            store.stats.hits += self.hit is not None
            store.stats.seeded += self.seed is not None


class FrozenBlockForward:
    """The frozen-prefix wrapper on one block (see the module docstring); innermost in its stack, so LCSB's
    and QuantizedMeBP's wrappers above it keep their bookkeeping."""

    name = FROZEN_WRAPPER
    persistent = False

    def __init__(self, prefix: FrozenPrefix, index: int) -> None:
        self.prefix, self.index = prefix, index

    def frozen(self) -> bool:
        return self.prefix.active(self.index)

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        prefix, store, batch = self.prefix, self.prefix.store, self.prefix.batch
        if not prefix.active(self.index) or batch is None:
            return inner(*args, **kwargs)
        last = self.index == prefix.frozen - 1
        hidden_in = hidden_input(args, kwargs)
        if self.index == 0:
            if hidden_in.grad_fn is not None and not prefix.below:
                prefix.below = trainable_leaves(hidden_in)
            batch.start_forward(hidden_in, kwargs, store)
        named = batch.named()
        if batch.hit is not None and named:
            output = store.rebuild_output(batch.hit if last else hidden_in.detach())
        elif batch.seed is not None and named and self.index < store.previous_frozen:
            output = store.rebuild_output(batch.seed if self.index == store.previous_frozen - 1 else hidden_in.detach())
        else:
            with torch.no_grad():
                output = inner(*args, **kwargs)
            if last and store.max_bytes > 0 and named:
                assert batch.probe is not None
                store.remember(batch.rows, batch.probe, output)
        if last and prefix.frozen < len(prefix.blocks) and uses_reentrant_checkpoint(prefix.blocks[prefix.frozen]):
            # a reentrant checkpoint back-propagates only into inputs that require grad
            output = replace_hidden(output, lambda hidden: hidden.detach().requires_grad_())
        return output


class FrozenPrefix:
    """Runs the ``frozen`` lowest of ``blocks`` without a graph and reuses their output per training example.

    Args:
        blocks: The transformer blocks, in order.
        max_bytes: At most this much stored output (the examples beyond it are recomputed every time);
            ``0`` stores nothing, and only the backward of the frozen blocks is saved.
        dtype: Store the outputs in this dtype (``torch.bfloat16`` halves the memory; then a replay is no
            longer bit-exact); ``None``: the activations' own.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        >>> prefix = FrozenPrefix(blocks)
        >>> prefix.freeze(2)
        >>> tokens = torch.tensor([[1, 2, 3]])
        >>> def forward():
        ...     prefix.set_batch(tokens)
        ...     h = torch.ones(1, 3, 4)
        ...     for block in blocks:
        ...         h = block(h)
        ...     prefix.end_batch()
        ...     return h
        >>> first, second = forward(), forward()  # the second skips blocks 0 and 1
        >>> bool(torch.equal(first, second)), prefix.stats.hits
        (True, 1)
        >>> prefix.remove()
    """

    def __init__(self, blocks: Sequence[nn.Module], max_bytes: int = 2**31, dtype: torch.dtype | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"`max_bytes={max_bytes}` must be >= 0 (0: store nothing).")
        self.blocks = list(blocks)
        self.frozen = 0  # how many of the lowest blocks are frozen
        self.store = _Store(int(max_bytes), dtype)
        self.batch: _Batch | None = None  # the current training batch; None: run the blocks as they are
        self.below: list[torch.Tensor] = []  # trainable tensors below the first block (an input embedding)
        self._stacks: list[ForwardStack] = []
        try:
            for index, block in enumerate(self.blocks):
                if get_wrapper(block, FROZEN_WRAPPER) is not None:
                    raise RuntimeError(f"{type(block).__name__} already has a frozen-prefix wrapper installed.")
                self._stacks.append(install_wrapper(block, FrozenBlockForward(self, index), innermost=True))
        except BaseException:
            self.remove()
            raise

    @property
    def stats(self) -> CacheStats:
        return self.store.stats

    @property
    def params_below(self) -> list[torch.Tensor]:
        """Trainable tensors found below the first block (an input embedding) by a frozen forward."""
        return list(self.below)

    @property
    def hit(self) -> bool:
        """Whether the current training batch replays its stored outputs."""
        return self.batch is not None and self.batch.hit is not None

    def active(self, index: int) -> bool:
        """Whether block ``index`` runs frozen in the current forward pass."""
        return index < self.frozen and self.batch is not None and self.blocks[index].training

    def freeze(self, num_blocks: int) -> None:
        """Freeze the ``num_blocks`` lowest blocks.

        A freeze that grows keeps the outputs stored so far until the newly frozen blocks have started from
        each of them once (an example's first pass then runs only the blocks frozen since); any other
        change empties the store.
        """
        if not 0 <= num_blocks <= len(self.blocks):
            raise ValueError(f"`num_blocks={num_blocks}` is outside 0..{len(self.blocks)} (the model's blocks).")
        if num_blocks > self.frozen > 0:
            self.store.grow(self.frozen)
        elif num_blocks != self.frozen:
            self.store.clear()
            self.below = []
        self.frozen = num_blocks
        dropout = _active_dropout(self.blocks[:num_blocks])
        if dropout:
            self.disable(f"dropout is active in the frozen blocks ({dropout}): a stored output would be one "
                         "sample of it. Set it to 0 (peft's lora_dropout) to reuse their outputs")

    def disable(self, reason: str) -> None:
        """Store nothing from now on, warning once with ``reason``; the frozen blocks still run without a graph."""
        self.store.disable(reason)

    def clear_store(self) -> None:
        """Forget every stored output (they were computed with weights that have changed since)."""
        self.store.clear()

    def set_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Name the examples of the training batch whose forward pass comes next (rows of ``input_ids``)."""
        if input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must be (batch, sequence), got shape {tuple(input_ids.shape)}.")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"`attention_mask` has shape {tuple(attention_mask.shape)}, `input_ids` "
                             f"{tuple(input_ids.shape)}.")
        if not self.frozen:
            self.batch = _Batch([])
        elif self.store.max_bytes:
            self.batch = _Batch(_rows(input_ids, attention_mask))
        else:  # storing nothing: no key to compute, no host copy
            self.batch = _Batch([_Row(b"", None)] * input_ids.shape[0])

    def end_batch(self) -> None:
        """The training batch is done: the next forward passes (evaluation) run the blocks as they are."""
        self.batch = None

    def remove(self) -> None:
        """Remove the wrappers and the stored outputs (idempotent)."""
        for block, stack in zip(self.blocks, self._stacks):
            remove_wrapper(block, FROZEN_WRAPPER, stack)
        self._stacks = []
        self.store.clear()


def is_frozen(block: nn.Module) -> bool:
    """Whether ``block`` runs frozen in the current training forward pass (False without a :class:`FrozenPrefix`)."""
    wrapper = get_wrapper(block, FROZEN_WRAPPER)
    return isinstance(wrapper, FrozenBlockForward) and wrapper.frozen()
