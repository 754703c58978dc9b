"""The recipes' training loader under Lightning: a resume from any checkpoint (mid-epoch, a later epoch, the
end of an epoch) reads exactly the batches an uninterrupted run reads, and each epoch has its seeded order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler

from lcsb_lightning.recipes.checkpointing import EpochShuffle, ResumableLoader

SIZE, BATCH, SEED = 10, 2, 7  # 5 batches an epoch
STEPS = 12


class Seen(LightningModule):
    """Records the example indices of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.tolist())
        return (self.weight * batch.float()).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> ResumableLoader:
    return ResumableLoader(list(range(SIZE)), batch_size=BATCH, sampler=EpochShuffle(SIZE, seed=SEED))


def _fit(root: Path, resume: Path | None = None) -> list[list[int]]:
    module = Seen()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root,
                      callbacks=[ModelCheckpoint(dirpath=root, filename="{step}", save_top_k=-1, every_n_train_steps=1)])
    trainer.fit(module, _loader(), ckpt_path=resume)
    return module.seen


def test_each_epoch_is_the_seeded_permutation_of_distributed_sampler(tmp_path: Path) -> None:
    seen = [i for batch in _fit(tmp_path) for i in batch]
    reference = DistributedSampler(list(range(SIZE)), num_replicas=1, rank=0, shuffle=True, seed=SEED)
    orders = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        orders += list(reference)
    assert seen == orders[: STEPS * BATCH]
    assert seen[:SIZE] != seen[SIZE : 2 * SIZE]  # a new order every epoch


@pytest.mark.parametrize("step", [3, 5, 7, 10])  # mid-epoch 0, end of epoch 0, mid-epoch 1, end of epoch 1
def test_resume_reads_the_batches_of_the_uninterrupted_run(tmp_path: Path, step: int) -> None:
    full = _fit(tmp_path / "full")
    checkpoint = tmp_path / "full" / f"step={step}.ckpt"
    state = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state[0]["sampler_epoch"] == (step - 1) // (SIZE // BATCH)
    assert state[0]["_num_yielded"] == (step - 1) % (SIZE // BATCH) + 1  # no batch fetched ahead
    assert _fit(tmp_path / "resumed", resume=checkpoint) == full[step:]


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_with_the_distributed_sampler_lightning_injects(rank: int) -> None:
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.pytorch.utilities.data import _update_dataloader

    def injected() -> Any:  # what Lightning does to the training loader under DDP (2 ranks)
        sampler = DistributedSampler(list(range(SIZE)), num_replicas=2, rank=rank, shuffle=True, seed=SEED)
        return _update_dataloader(_loader(), sampler)

    loader = injected()
    _set_sampler_epoch(loader, 1)
    epoch = [batch.tolist() for batch in loader]
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = injected()  # a new process: the sampler is at epoch 0 until Lightning's set_epoch, after iter()
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == epoch[1:]
