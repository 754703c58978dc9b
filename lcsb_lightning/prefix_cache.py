"""Plain-torch core of progressive freezing: the lowest blocks run without a graph and their output is reused.

Once the ``k`` lowest blocks are frozen, block ``k``'s input depends on the example alone, so block ``k - 1``'s
output is stored per training example (:mod:`lcsb_lightning.prefix_store`) and replayed (AutoFreeze / Egeria). Only
the first forward after :meth:`~FrozenPrefix.set_batch` replays or stores. The caller freezes the prefix's parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from lcsb_lightning.forward_wrap import ForwardStack, get_wrapper, install_wrapper, remove_wrapper
from lcsb_lightning.hidden_states import hidden_input, replace_hidden, trainable_leaves, uses_reentrant_checkpoint
from lcsb_lightning.prefix_store import CacheStats, OutputStore, Row, batch_rows, input_probe

#: Name of the frozen-prefix wrapper in a block's forward stack.
FROZEN_WRAPPER = "lcsb_frozen_prefix"
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _active_dropout(blocks: Sequence[nn.Module]) -> str | None:
    """The first dropout of ``blocks`` that is active (training mode, ``p > 0``), described; None if there is none."""
    for index, block in enumerate(blocks):
        for name, module in block.named_modules():
            p = module.p if isinstance(module, _DROPOUTS) else getattr(module, "attention_dropout", 0.0)
            if module.training and isinstance(p, (int, float)) and p > 0:
                return f"block {index}'s {name or 'itself'}: {type(module).__name__}, p={p}"
    return None


class _Batch:
    """The current training batch: whether its first forward replays, is seeded by the previous outputs or stores."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows
        self.forwards = self.size = 0  # block 0's forwards since set_batch (the first replays or stores), its rows
        self.probe: torch.Tensor | None = None  # the first forward's probe of block 0's input (see input_probe)
        self.hit: torch.Tensor | None = None  # block frozen - 1's output for the whole batch, when all rows are stored
        self.seed: torch.Tensor | None = None  # the previous outputs of the whole batch (no hit, all rows in previous)

    @property
    def replayed(self) -> bool:
        return self.hit is not None or self.seed is not None

    def named(self) -> bool:
        """Whether the running forward pass is the first since :meth:`FrozenPrefix.set_batch`, with its rows."""
        return self.forwards == 1 and self.size == len(self.rows)

    def start_forward(self, hidden: torch.Tensor, kwargs: dict[str, Any], store: OutputStore) -> None:
        """Block 0 starts a forward pass on ``hidden``: decide, for the named one, whether it replays."""
        self.forwards, self.size = self.forwards + 1, hidden.shape[0]
        if not self.named():
            return
        store.stats.batches += 1
        if store.max_bytes > 0:
            self.probe = input_probe(hidden, kwargs)
            self.hit = store.assemble(store.entries, self.rows, self.probe, hidden.device)
            self.seed = None if self.hit is not None else store.assemble(store.previous, self.rows, self.probe,
                                                                         hidden.device)
            store.stats.hits += self.hit is not None
            store.stats.seeded += self.seed is not None


class FrozenBlockForward:
    """The frozen-prefix wrapper on one block; innermost, so LCSB's and QuantizedMeBP's wrappers keep their books."""

    name = FROZEN_WRAPPER
    persistent = False

    def __init__(self, prefix: FrozenPrefix, index: int) -> None:
        self.prefix, self.index = prefix, index

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        prefix, store, batch = self.prefix, self.prefix.store, self.prefix.batch
        if not prefix.active(self.index) or batch is None:
            output = inner(*args, **kwargs)
            if self.index == len(prefix.blocks) - 1 and batch is not None and batch.named() and prefix.active(0):
                output = store.watch_top(batch.rows, output, batch.replayed)
            return output
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
        if last and named:
            output = store.watch_leaf(batch.rows, output, batch.replayed)
        if last and prefix.frozen < len(prefix.blocks) and uses_reentrant_checkpoint(prefix.blocks[prefix.frozen]):
            # a reentrant checkpoint back-propagates only into inputs that require grad
            output = replace_hidden(output, _requiring_grad)
        return output


def _requiring_grad(hidden: torch.Tensor) -> torch.Tensor:
    return hidden if hidden.requires_grad else hidden.detach().requires_grad_()


class FrozenPrefix:
    """Runs the ``frozen`` lowest of ``blocks`` without a graph and reuses their output per training example.

    Args:
        blocks: The transformer blocks, in order.
        max_bytes: At most this much stored output (the examples beyond it are recomputed every time);
            ``0`` stores nothing, and only the backward of the frozen blocks is saved.

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

    def __init__(self, blocks: Sequence[nn.Module], max_bytes: int = 2**31) -> None:
        if max_bytes < 0:
            raise ValueError(f"`max_bytes={max_bytes}` must be >= 0 (0: store nothing).")
        self.blocks = list(blocks)
        self.frozen = 0  # how many of the lowest blocks are frozen
        self.store = OutputStore(int(max_bytes))
        self.batch: _Batch | None = None  # the current training batch; None: run the blocks as they are
        self.below: list[torch.Tensor] = []  # trainable tensors below the first block (an input embedding)
        self._stacks: list[ForwardStack] = []
        try:
            for index, block in enumerate(self.blocks):
                self._stacks.append(install_wrapper(block, FrozenBlockForward(self, index), innermost=True))
        except BaseException:
            self.remove()
            raise

    @property
    def stats(self) -> CacheStats:
        return self.store.stats

    @property
    def padding_read(self) -> bool | None:
        """Whether the loss reads the frozen blocks' output at padded positions (None until a gradient showed it)."""
        return self.store.padding_read

    @property
    def hit(self) -> bool:
        """Whether the current training batch replays its stored outputs."""
        return self.batch is not None and self.batch.hit is not None

    def active(self, index: int) -> bool:
        """Whether block ``index`` runs frozen in the current forward pass."""
        return index < self.frozen and self.batch is not None and self.blocks[index].training

    def freeze(self, num_blocks: int) -> None:
        """Freeze the ``num_blocks`` lowest blocks (growing seeds from the stored outputs, other changes clear them)."""
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
            self.store.disable(f"dropout is active in the frozen blocks ({dropout}): a stored output would be one "
                               "sample of it. Set it to 0 (peft's lora_dropout) to reuse their outputs")

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
            self.batch = _Batch(batch_rows(input_ids, attention_mask))
        else:  # storing nothing: no key to compute, no host copy
            self.batch = _Batch([Row(b"", None)] * input_ids.shape[0])

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
    return isinstance(wrapper, FrozenBlockForward) and wrapper.prefix.active(wrapper.index)
