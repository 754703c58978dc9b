"""``ProgressiveFreezing``: freeze the lowest blocks epoch by epoch and reuse their outputs (multi-epoch runs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lcsb_lightning.blocks import BlocksSpec, find_blocks, shared_param_ids
from lcsb_lightning.fit_scoped import FitScopedCallback
from lcsb_lightning.prefix_cache import FrozenPrefix

def _check_schedule(schedule: Mapping[Any, Any] | Sequence[Sequence[Any]]) -> dict[int, int | float]:
    """``schedule`` (a mapping, or ``[epoch, blocks]`` pairs as a Hydra override gives) as ``{epoch: blocks}``."""
    usage = "a mapping epoch -> blocks to freeze (a count, or a fraction in (0, 1) of the blocks), e.g. {1: 0.5}, or [[1, 0.5]]"
    if isinstance(schedule, Mapping):
        pairs = list(schedule.items())
    elif isinstance(schedule, Sequence) and not isinstance(schedule, str) and all(
            isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2 for p in schedule):
        pairs = [(p[0], p[1]) for p in schedule]
    else:
        raise ValueError(f"`schedule={schedule!r}` must be {usage}.")
    if not pairs:
        raise ValueError(f"`schedule={schedule!r}` is empty; it must be {usage}.")
    out: dict[int, int | float] = {}
    for epoch, amount in pairs:
        if isinstance(epoch, str) and epoch.isdigit():  # a key from a dotted override: freeze.schedule.2=0.75
            epoch = int(epoch)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"`schedule` key {epoch!r} must be an epoch: an integer >= 0.")
        bad_count = isinstance(amount, int) and amount < 0
        bad_share = isinstance(amount, float) and not 0.0 < amount < 1.0
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or bad_count or bad_share:
            raise ValueError(f"`schedule[{epoch}]={amount!r}` must be a block count (int >= 0) or a fraction in (0, 1).")
        if epoch in out:
            raise ValueError(f"`schedule` names epoch {epoch} twice.")
        out[epoch] = amount
    return dict(sorted(out.items()))


class ProgressiveFreezing(FitScopedCallback):
    r"""Freeze the lowest transformer blocks as the epochs go by, and stop computing them at all.

    From the epochs named in ``schedule`` on, the lowest blocks (and a trainable input embedding below them) get
    ``requires_grad=False`` and run without a graph; with ``cache=True`` their output per training example is stored
    (:class:`~lcsb_lightning.prefix_cache.FrozenPrefix`), so later epochs skip their forward too (AutoFreeze / Egeria).
    Beside :class:`~lcsb_lightning.LCSBCallback`, its policy selects over the blocks that still train. ``requires_grad``
    comes back when fit ends; a resumed fit re-freezes before its first batch. Not a ``BaseFinetuning``: its
    ``make_trainable`` would also turn on the base weights, and its hook is skipped on a mid-epoch resume.

    Args:
        schedule: ``{epoch: blocks}`` (or ``[[epoch, blocks], ...]``): from that (0-based) epoch on, freeze that
            many of the lowest blocks (an int), or that share of them (a float in (0, 1)); never fewer than before.
        cache: Store the frozen blocks' outputs per example, in host memory, and reuse them (not while a dropout is
            active in them). ``False``: only their backward is saved.
        max_cache_mb: At most this many MB of stored outputs (the rest are recomputed every epoch).
        blocks: How to find the blocks, as for :class:`~lcsb_lightning.LCSBCallback`.

    Raises:
        ValueError: A bad argument; at fit start, several processes, a schedule that freezes every block, or a
            trainable input embedding tied to the LM head with ``cache=True``.

    Example::

        >>> from lcsb_lightning import LCSBCallback
        >>> callbacks = [LCSBCallback("full"), ProgressiveFreezing({1: 0.5, 2: 0.75})]
    """

    def __init__(self, schedule: Mapping[int, int | float] | Sequence[Sequence[int | float]], cache: bool = True,
                 max_cache_mb: float = 2048.0, blocks: BlocksSpec = "auto") -> None:
        self.schedule = _check_schedule(schedule)
        if not isinstance(max_cache_mb, (int, float)) or isinstance(max_cache_mb, bool) or max_cache_mb < 0:
            raise ValueError(f"`max_cache_mb={max_cache_mb!r}` must be a number >= 0.")
        self.cache, self.max_cache_mb, self.blocks = bool(cache), float(max_cache_mb), blocks
        self.prefix: FrozenPrefix | None = None
        self.frozen = 0
        self._frozen_params: list[nn.Parameter] = []
        self._tied: frozenset[int] = frozenset()  # ids of the parameters used twice (an embedding tied to the head): never frozen
        self._no_ids_warned = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(schedule=tuple(self.schedule.items()))

    def blocks_at(self, epoch: int, num_blocks: int) -> int:
        """How many of ``num_blocks`` blocks the schedule freezes in ``epoch``."""
        amounts = [amount for start, amount in self.schedule.items() if start <= epoch]
        amount = amounts[-1] if amounts else 0
        return int(amount * num_blocks) if isinstance(amount, float) else int(amount)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._release()
        self.frozen = 0  # a new fit starts unfrozen; a checkpoint's load_state_dict comes after this
        if trainer.world_size > 1:
            raise ValueError(
                f"ProgressiveFreezing runs in one process; this Trainer has {trainer.world_size}. Freezing "
                "changes requires_grad during fit, which DDP and FSDP do not allow."
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        found = find_blocks(pl_module, self.blocks)
        counts = [self.blocks_at(epoch, len(found)) for epoch in self.schedule]
        if max(counts) >= len(found):
            raise ValueError(f"`schedule={self.schedule}` freezes {max(counts)} of the model's {len(found)} blocks; "
                             f"allowed: fewer than {len(found)} (something above them has to train).")
        if any(later < earlier for earlier, later in zip(counts, counts[1:])):
            raise ValueError(f"`schedule={self.schedule}` unfreezes blocks ({counts} frozen); a freeze only grows.")
        self._tied = shared_param_ids(pl_module)
        tied = next((name for name, p in pl_module.named_parameters() if id(p) in _embedding_ids(pl_module) and p.requires_grad
                     and id(p) in self._tied), None)
        if tied and self.cache and max(counts) > 0:
            raise ValueError(
                f"The input embedding ({tied}) trains and is tied to the LM head: it changes at every step, so "
                "the frozen blocks' outputs cannot be reused. Freeze it, untie it (peft's modules_to_save trains "
                "an untied copy), or use ProgressiveFreezing(cache=False)."
            )
        max_bytes = int(self.max_cache_mb * 2**20) if self.cache else 0
        self.prefix = FrozenPrefix(found, max_bytes=max_bytes)
        rank_zero_info(f"ProgressiveFreezing: {dict(zip(self.schedule, counts))} of {len(found)} blocks frozen by "
                       f"epoch, cache={'on' if self.cache else 'off'}.")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Restored from a checkpoint: Lightning skips on_train_epoch_start when it resumes mid-epoch. Not in
        # on_fit_start: a callback after this one (LCSBCallback) maps the trainable parameters there.
        if self.frozen:
            self._freeze(pl_module, self.frozen)

    def _release(self) -> None:
        if self.prefix is not None:
            self.prefix.remove()
            self.prefix = None
        for p in self._frozen_params:
            p.requires_grad_(True)
        self._frozen_params = []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self.prefix is not None
        target = max(self.blocks_at(trainer.current_epoch, len(self.prefix.blocks)), self.frozen)
        if target == self.prefix.frozen:
            return
        self._freeze(pl_module, target)
        rank_zero_info(f"ProgressiveFreezing: epoch {trainer.current_epoch}: the lowest {target} blocks are frozen.")

    def _freeze(self, pl_module: LightningModule, num_blocks: int) -> None:
        assert self.prefix is not None
        self.prefix.freeze(num_blocks)
        self.frozen = num_blocks
        params = [p for block in self.prefix.blocks[:num_blocks] for p in block.parameters()]
        params += [p for p in pl_module.parameters() if id(p) in _embedding_ids(pl_module)]  # below the first block
        self._freeze_params(params)

    def _freeze_params(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.requires_grad and id(p) not in self._tied:
                p.requires_grad_(False)
                p.grad = None
                self._frozen_params.append(p)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.prefix is not None
        if not self.prefix.frozen:
            return
        ids, mask = _token_rows(batch)
        if ids is None:
            if not self._no_ids_warned:
                self._no_ids_warned = True
                rank_zero_warn("ProgressiveFreezing found no `input_ids` in the batch (a dict with `input_ids`, or "
                               "a 2-D integer tensor): it freezes blocks but stores no outputs.")
            return
        self.prefix.set_batch(ids, mask)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.prefix is not None
        if not self.prefix.frozen:
            return
        hit = self.prefix.hit
        self.prefix.end_batch()
        below = [p for p in self.prefix.below if p.requires_grad]
        if below:  # found by the graph, for a model without get_input_embeddings()
            self._freeze_params(below)  # type: ignore[arg-type]
            self.prefix.store.clear()  # computed while they still trained
            if any(p.requires_grad for p in below):
                self.prefix.store.disable("a tensor below the first block trains on (tied to the LM head)")
        pl_module.log("freeze/frozen_blocks", float(self.prefix.frozen), on_step=False, on_epoch=True, batch_size=1)
        pl_module.log("freeze/cache_hit", float(hit), on_step=False, on_epoch=True, batch_size=1)
        pl_module.log("freeze/cache_mb", self.prefix.stats.stored_bytes / 2**20, on_step=False, on_epoch=True,
                      reduce_fx="max", batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return {"frozen": self.frozen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.frozen = int(state_dict.get("frozen", 0))


def _embedding_ids(module: nn.Module) -> set[int]:
    """Ids of the input embedding's parameters (Hugging Face's ``get_input_embeddings()``), if one is found."""
    for sub in module.modules():
        get = getattr(sub, "get_input_embeddings", None)
        if callable(get):
            embedding = get()
            if isinstance(embedding, nn.Module):
                return {id(p) for p in embedding.parameters()}
    return set()


def _token_rows(batch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(input_ids, attention_mask)`` of a batch: a mapping with ``input_ids``, or a 2-D integer tensor (or a
    tuple / list led by one)."""
    if isinstance(batch, Mapping):
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
        return (ids, mask if isinstance(mask, torch.Tensor) else None) if isinstance(ids, torch.Tensor) else (None, None)
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if isinstance(batch, torch.Tensor) and batch.dim() == 2 and not batch.is_floating_point():
        return batch, None
    return None, None
