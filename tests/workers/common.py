"""Pieces shared by the multi-process workers: a rank-strided loader, a recorder, the per-rank result file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, Sampler

from lcsb_lightning import LCSBCallback
from tests.conftest import token_batches


class StridedSampler(Sampler[int]):
    """Rank ``r`` of ``w`` reads sequences ``r, r + w, ...``: one global batch of 4 is the same 4 sequences
    on one process or on two (where Lightning's own DistributedSampler would shuffle)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def _rank_world(self) -> tuple[int, int]:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def __iter__(self) -> Iterator[int]:
        rank, world = self._rank_world()
        return iter(range(rank, self.size, world))

    def __len__(self) -> int:
        return self.size // self._rank_world()[1]


class Record(Callback):
    def __init__(self, lcsb: LCSBCallback) -> None:
        self.lcsb = lcsb
        self.selections: list[list[int]] = []
        self.block0: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.selections.append(list(self.lcsb.selection))
        block0 = self.lcsb.controller.block_params.params_per_block[0]
        self.block0.append([v for p in block0 for v in full_values(p)][:8])


def strided_loader(per_rank_batch: int, ragged: bool = False) -> DataLoader:
    """The same 32 sequences of 12 tokens (vocabulary 64) on any world size, a global batch of 4; ``ragged``:
    rank ``r`` cuts its sequences to ``12 - 4 r`` tokens, so the ranks' batches differ in shape."""
    dataset = token_batches(num_batches=8, batch=4, seq=12, vocab=64).dataset

    def collate(rows: list[tuple[torch.Tensor]]) -> list[torch.Tensor]:
        tokens = torch.stack([row[0] for row in rows])
        return [tokens[:, : 12 - 4 * StridedSampler(0)._rank_world()[0]] if ragged else tokens]

    return DataLoader(dataset, batch_size=per_rank_batch, sampler=StridedSampler(len(dataset)), collate_fn=collate)


def full_values(param: torch.Tensor) -> list[float]:
    """A parameter's values as a flat list (a sharded DTensor is gathered first: a collective)."""
    full_tensor = getattr(param, "full_tensor", None)
    tensor = full_tensor() if callable(full_tensor) else param
    return tensor.detach().flatten().tolist()


def write_rank(folder: Path, trainer: Trainer, module: LightningModule, lcsb: LCSBCallback, record: Any) -> None:
    lora = {n: full_values(p) for n, p in module.named_parameters() if "lora_" in n}
    result = {"rank": trainer.global_rank, "world": trainer.world_size, "selections": record.selections,
              "block0": record.block0, "losses": module.losses, "lora": lora, "counts": lcsb.selection_counts}
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"rank{trainer.global_rank}.json", "w") as handle:
        json.dump(result, handle)
