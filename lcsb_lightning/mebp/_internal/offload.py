"""Saved-tensor offload to memory-mapped files (MeBP's ``offload="mmap"``): inside :meth:`MmapOffload.hooks`
every saved tensor of at least ``min_bytes`` goes to its own file, deleted once autograd frees its handle.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
import tempfile
import weakref
from typing import Any

import torch
from torch import nn


class _OnDisk:
    """Handle of one offloaded tensor; its file is removed when the handle is collected."""

    __slots__ = ("path", "dtype", "shape", "device", "nbytes", "__weakref__")

    def __init__(self, path: str, tensor: torch.Tensor) -> None:
        self.path = path
        self.dtype = tensor.dtype
        self.shape = tensor.shape
        self.device = tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        try:
            with open(path, "wb") as handle:
                tensor.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tofile(handle)
        except OSError as exc:
            _unlink(path)
            reason = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
            raise OSError(exc.errno, f"QuantizedMeBP could not write the offload file {path} ({self.nbytes} bytes): "
                                     f"{reason}; free space there or set offload_dir= to a larger disk") from exc
        weakref.finalize(self, _unlink, path)

    def load(self) -> torch.Tensor:
        data = torch.from_file(self.path, shared=False, size=self.nbytes, dtype=torch.uint8)
        return data.view(self.dtype).reshape(self.shape).to(self.device)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class MmapOffload:
    """Writes saved activations to files in a temporary directory under ``parent_dir`` (default: the
    system temp dir), read back as private memory maps; tensors under ``min_bytes`` stay in RAM."""

    def __init__(self, parent_dir: str | None = None, min_bytes: int = 1 << 10) -> None:
        if min_bytes < 0:
            raise ValueError(f"`min_bytes` must be >= 0, got {min_bytes}.")
        self.__setstate__({"min_bytes": min_bytes, "parent_dir": parent_dir})

    def _open(self) -> None:
        self.path = tempfile.mkdtemp(prefix="lcsb_mebp_", dir=self.parent_dir)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)  # also runs at exit

    def __getstate__(self) -> dict[str, Any]:
        return {"min_bytes": self.min_bytes, "parent_dir": self.parent_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (deepcopy, pickle) writes into a directory of its own, never into the original's."""
        self.min_bytes, self.parent_dir = state["min_bytes"], state["parent_dir"]
        self._counter = itertools.count()
        self.bytes_written = 0
        self._open()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        if isinstance(tensor, nn.Parameter) or nbytes < self.min_bytes or tensor.layout != torch.strided:
            return tensor
        if self.closed:  # reused after close() (a second fit): new directory, new finalizer
            self._open()
        elif not os.path.isdir(self.path):
            os.makedirs(self.path, exist_ok=True)
        self.bytes_written += nbytes
        return _OnDisk(os.path.join(self.path, f"{next(self._counter)}.bin"), tensor)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.load() if isinstance(packed, _OnDisk) else packed

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context under which saved tensors go to disk."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def files(self) -> list[str]:
        """Offload files currently on disk."""
        return sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []

    def close(self) -> None:
        """Remove the temporary directory; idempotent (a later offload opens a new one)."""
        self._finalizer()
