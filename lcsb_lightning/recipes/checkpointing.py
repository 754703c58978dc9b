"""Crash-safe checkpoints of a recipe run: atomic writes, LoRA-sized contents, an exact data position.

* :class:`AtomicCheckpointIO` writes a checkpoint next to its destination and renames it into place,
  so a crash or a full disk never leaves a half-written file where the last good one was.
* :class:`ResumableLoader` shuffles with one seeded permutation per epoch and reports how far into
  the epoch training got, so a resumed run reads exactly the batches an uninterrupted one would.
* :func:`resolve_checkpoint` / :func:`check_checkpoint` find and validate what ``resume=`` names,
  before any model is loaded.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch.utils.data import DataLoader, Sampler

CHECKPOINT_DIR = "checkpoints"
LAST = "last.ckpt"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes to a temporary file in the destination folder, then renames it.

    Raises:
        OSError: the write failed (for example ``ENOSPC``); the message names the destination, the
            temporary file is removed and any previous checkpoint at that path is untouched.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        destination = Path(path)
        destination.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, destination)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            reason = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
            raise OSError(exc.errno, f"could not write the checkpoint {destination}: {reason}; the previous "
                                     "checkpoint there, if any, is intact") from exc
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class ResumableSampler(Sampler[int]):
    """A seeded permutation per epoch (``seed + epoch``), starting ``skip`` samples in after a resume."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, samples to skip)

    def set_epoch(self, epoch: int) -> None:  # called by Lightning at every epoch start
        self.epoch = epoch

    def resume(self, epoch: int, samples: int) -> None:
        self.epoch, self._resume = epoch, (epoch, samples)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip = self._resume[1]
        self._resume = None
        return iter(order[skip:])

    def __len__(self) -> int:
        return self.size


class ResumableLoader(DataLoader):
    """The training loader of the recipes: Lightning saves its ``state_dict`` in every checkpoint (the
    epoch and the batches consumed in it) and restores it before the epoch's iterator is created."""

    def __init__(self, dataset: Any, batch_size: int, seed: int, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=ResumableSampler(len(dataset), seed), **kwargs)
        self._trainer: Any = None

    def bind(self, trainer: Any) -> None:
        """Read the training progress from ``trainer`` (its processed batches of the current epoch)."""
        self._trainer = trainer

    def state_dict(self) -> dict[str, int]:
        if self._trainer is None:
            return {}
        progress = self._trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": int(self._trainer.current_epoch), "batches": int(progress.processed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state:
            assert isinstance(self.sampler, ResumableSampler)
            self.sampler.resume(int(state["epoch"]), int(state["batches"]) * int(self.batch_size or 1))


def resolve_checkpoint(resume: str | os.PathLike[str]) -> Path:
    """The checkpoint ``resume=`` names: a ``.ckpt`` file, or a run folder (its ``checkpoints/last.ckpt``).

    Raises:
        FileNotFoundError: neither exists.
    """
    path = Path(resume).expanduser()
    if path.is_dir():
        path = path / CHECKPOINT_DIR / LAST
    if not path.is_file():
        raise FileNotFoundError(f"resume={str(resume)!r}: no checkpoint at {path} (a run folder holds checkpoints/{LAST})")
    return path


def check_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint on the CPU, or raise a ``ValueError`` naming the file (truncated, corrupted, or
    not a recipe checkpoint) before any training."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ValueError(f"the checkpoint {path} cannot be read ({type(exc).__name__}: {exc}); it is truncated or "
                         "corrupted: resume from an earlier one, or start again") from exc
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "global_step" not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint of lcsb-finetune (no state_dict/global_step)")
    return checkpoint
