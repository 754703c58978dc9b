"""Crash-safe checkpoints of a recipe run: atomic writes, an exact data position, a checkpoint on SIGTERM/SIGINT, and
what ``resume=`` names found and validated before any model is loaded."""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lcsb_lightning.atomic_files import atomic_file

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAST = "last.ckpt"
_EPOCH = "sampler_epoch"  # ResumableLoader's own entry in a StatefulDataLoader state
_YIELDED = "_num_yielded"  # the batches a single-process StatefulDataLoader iterator yielded


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes through :func:`~lcsb_lightning.atomic_files.atomic_file`.

    Lightning's own write moves a temporary file, which between filesystems (a tmpfs ``/tmp``) copies into the
    destination: a full disk or a crash mid-copy leaves a truncated file where the previous checkpoint was.

    Raises:
        OSError: the write failed (for example ``ENOSPC``); any previous checkpoint at that path is untouched.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        destination = Path(path)
        try:
            with atomic_file(destination, "wb") as handle:
                torch.save(checkpoint, handle)
        except OSError as exc:
            reason = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
            raise OSError(exc.errno, f"could not write the checkpoint {destination}: {reason}; the previous "
                                     "checkpoint there, if any, is intact") from exc


class EpochShuffle(RandomSampler):
    """One permutation of ``range(size)`` per epoch, ``torch.randperm`` seeded with ``seed + epoch``: the order of
    ``DistributedSampler(shuffle=True, seed=seed)``, which Lightning puts in its place under DDP.

    Args:
        size: The number of examples.
        seed: The seed of epoch 0.
    """

    def __init__(self, size: int, seed: int) -> None:
        super().__init__(range(size))
        self.size, self.seed = size, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at every epoch start (and by :class:`ResumableLoader` on a resume)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


class ResumableLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` whose state also holds its sampler's epoch (on a resume the epoch's iterator is
    created before Lightning calls ``set_epoch``); a checkpoint after an epoch's last batch resumes at the next one.
    Pass ``sampler=EpochShuffle(...)``; single-process (``num_workers=0``)."""

    def _epoch_sampler(self) -> Any:
        # Lightning puts its DistributedSampler inside the batch sampler (torchdata's BatchSampler is not torch's)
        for sampler in (getattr(self.batch_sampler, "sampler", None), self.sampler):
            if callable(getattr(sampler, "set_epoch", None)):
                return sampler
        return None

    def state_dict(self) -> dict[str, Any]:
        sampler = self._epoch_sampler()
        return {**super().state_dict(), _EPOCH: int(getattr(sampler, "epoch", 0))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        epoch, sampler = state.pop(_EPOCH, None), self._epoch_sampler()
        if epoch is not None and sampler is not None:
            if state.get(_YIELDED, 0) >= len(self):  # the epoch was over: the next one starts afresh
                epoch, state = epoch + 1, {}
            sampler.set_epoch(int(epoch))
        super().load_state_dict(state)


class Preempted(SystemExit):
    """Raised by the recipe run after a preemption checkpoint, with exit status ``128 + signal`` (as a shell's)."""


class PreemptionCheckpoint(Checkpoint):
    """On SIGTERM (SLURM, spot instances) or SIGINT (Ctrl-C), write the resumable checkpoint ``path`` at the
    end of the current optimizer step (after a whole accumulation window: a checkpoint holds no gradients) and
    stop the fit with Lightning's ``SIGTERMException`` before the next.

    Under DDP the ranks decide together at that point (Lightning's own handler broadcasts from inside the handler,
    which can pair with another collective and hang). A second Ctrl-C interrupts at once; an ignored signal
    (``nohup``) stays ignored.

    Args:
        path: Where the checkpoint goes (the recipe's ``checkpoints/last.ckpt``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        #: The signal that stopped the run (``None`` while it runs).
        self.signum: int | None = None
        #: The global step of the checkpoint written on that signal (``None`` if none was).
        self.saved_step: int | None = None
        self._previous: dict[int, Any] = {}
        self._step_at_start = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:  # nohup or a script's background job: the signal is not for this run
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = self.signum or signum
        log.warning("received %s: the run stops after this training step with a checkpoint", signal.Signals(signum).name)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._step_at_start:
            return  # inside a gradient-accumulation window: its gradients are in no checkpoint, save after its step
        stop = self.signum is not None
        if trainer.world_size > 1:  # every rank takes part in the save: decide together
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            trainer.save_checkpoint(self.path, weights_only=False)
            self.saved_step = int(trainer.global_step)
            self.signum = self.signum or signal.SIGTERM  # a rank told by another

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_at_start = trainer.global_step
        if self.saved_step is not None:  # stop once the saved step is logged (and validated, when due)
            raise SIGTERMException

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def exit_code(self) -> int:
        """``128 + signal``, the status :class:`Preempted` exits with."""
        return 128 + int(self.signum or signal.SIGTERM)


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
    """The checkpoint loaded on the CPU with ``weights_only=True``, or a ``ValueError`` naming the file."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ValueError(f"the checkpoint {path} cannot be read with weights_only=True ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}); it is truncated or corrupted, or holds objects "
                         "other than tensors: resume from an earlier one, or start again") from exc
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "global_step" not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint of lcsb-finetune (no state_dict/global_step)")
    return checkpoint
