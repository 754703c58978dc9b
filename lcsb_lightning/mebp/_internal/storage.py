"""Compressed weights in memory-mapped files, resident only while their layer runs (``weights="mmap"``), as
MeBP maps them from flash on a phone: each tensor is written to a file and mapped back, and
:meth:`MappedWeights.release` drops a layer's pages (``madvise(MADV_DONTNEED)``) after it decompressed them.
Linux and macOS, CPU tensors only; the directory must be on a disk (on tmpfs the bytes stay in RAM).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import shutil
import sys
import tempfile
import warnings
import weakref
from typing import Any

import torch

from lcsb_lightning.mebp._internal.stored import Packed
from lcsb_lightning.rank_zero import rank_zero_info

_MADV_DONTNEED = 4  # the same value on Linux and macOS


def _libc_madvise() -> Any:
    name = ctypes.util.find_library("c")
    if name is None or not sys.platform.startswith(("linux", "darwin")):
        return None
    madvise = getattr(ctypes.CDLL(name, use_errno=True), "madvise", None)
    if madvise is not None:
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _libc_madvise()


def filesystem_type(path: str) -> str | None:
    """The type of the file system holding ``path`` (from ``/proc/mounts``; None where unknown)."""
    try:
        with open("/proc/mounts") as handle:
            mounts = [line.split()[1:3] for line in handle if len(line.split()) >= 3]
    except OSError:
        return None
    real = os.path.realpath(path)
    holding = [(point, kind) for point, kind in mounts if real == point or real.startswith(point.rstrip("/") + "/")]
    return max(holding, key=lambda mount: len(mount[0]))[1] if holding else None  # the innermost mount


def mmap_supported() -> bool:
    """Whether this platform can release mapped pages (``weights="mmap"``)."""
    return _MADVISE is not None


def on_ram_file_system(directory: str | None) -> bool:
    """Whether ``directory`` (the system temp dir for None) is on a RAM file system: mapping saves nothing there."""
    return filesystem_type(directory or tempfile.gettempdir()) in ("tmpfs", "ramfs")


def accelerator_available() -> bool:
    """Whether Lightning's ``accelerator="auto"`` would train on an accelerator here (XLA, MPS, CUDA)."""
    from lightning.fabric.accelerators import CUDAAccelerator, MPSAccelerator, XLAAccelerator

    return any(accelerator.is_available() for accelerator in (XLAAccelerator, MPSAccelerator, CUDAAccelerator))


_auto_reasons_logged: set[str] = set()


def maps_for_training(weights: str, device: torch.device, directory: str | None) -> bool:
    """Whether compressed weights that train on ``device`` go to memory-mapped files (``directory``:
    ``offload_dir``); why ``"auto"`` keeps CPU weights in RAM is logged once per process and reason."""
    if weights != "auto" or device.type != "cpu":
        return weights == "mmap" and device.type == "cpu"
    reason = None
    if not mmap_supported():
        reason = "this platform has no madvise"
    elif on_ram_file_system(directory):
        reason = f"{directory or tempfile.gettempdir()} is on a RAM file system (set offload_dir to a disk directory)"
    if reason is not None and reason not in _auto_reasons_logged:
        _auto_reasons_logged.add(reason)
        rank_zero_info(f"QuantizedMeBP: weights='auto' keeps the compressed weights in RAM: {reason}.")
    return reason is None


def maps_at_conversion(weights: str, device: torch.device, directory: str | None) -> bool:
    """Whether ``apply_mebp``/``load_compressed`` map the weights they compress on ``device`` right away:
    ``"auto"`` only on a machine without an accelerator; else ``QuantizedMeBP`` decides at fit start."""
    if weights == "auto" and accelerator_available():
        return False
    return maps_for_training(weights, device, directory)


class MappedWeights:
    """Writes compressed tensors to files in a temporary directory under ``parent_dir`` and maps them back.

    Its mappings are held weakly: they live as long as the tensors holding them (a model moved off the CPU
    drops them), and it releases only mappings it made (``MADV_DONTNEED`` on heap pages would zero them).
    """

    def __init__(self, parent_dir: str | None = None) -> None:
        if not mmap_supported():
            raise OSError(f"`weights='mmap'` needs madvise (Linux or macOS); this is {sys.platform}. Use weights='ram'.")
        self.parent_dir = parent_dir
        self.path = tempfile.mkdtemp(prefix="lcsb_mebp_weights_", dir=parent_dir)
        if on_ram_file_system(self.path):
            warnings.warn(f"QuantizedMeBP's weights='mmap' directory {self.path} is on a RAM file system: the "
                          "compressed weights stay in RAM (as shared memory, outside the process's RSS); set "
                          "offload_dir to a directory on a disk.", UserWarning, stacklevel=3)
        self._counter = itertools.count()
        self.bytes_mapped = 0
        # By start address: while a mapping lives no other allocation can have its address.
        self._mappings: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)  # also runs at exit

    def _map_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        path = os.path.join(self.path, f"{next(self._counter)}.bin")
        data = tensor.detach().contiguous().cpu()
        with open(path, "wb") as handle:
            data.reshape(-1).view(torch.uint8).numpy().tofile(handle)
        mapped = torch.from_file(path, shared=True, size=data.numel(), dtype=data.dtype).reshape(data.shape)
        os.unlink(path)  # the mapping keeps the file's pages; nothing is left on disk after exit
        self.bytes_mapped += data.numel() * data.element_size()
        storage = mapped.untyped_storage()
        self._mappings[storage.data_ptr()] = weakref.ref(storage)
        self.release(mapped)
        return mapped

    def map(self, packed: Packed) -> Packed:
        """A copy of ``packed`` whose codes, scales (and minimums) live in memory-mapped files."""
        return Packed(*map(self._map_tensor, packed.tensors()))

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or the tensor it is a view of) is one of this store's live mappings."""
        if tensor.device.type != "cpu":
            return False
        ref = self._mappings.get(tensor.untyped_storage().data_ptr())
        return ref is not None and ref() is not None

    def live_mappings(self) -> int:
        """How many of this store's mappings some tensor still holds."""
        return sum(ref() is not None for ref in self._mappings.values())

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the resident pages of a tensor this store mapped (the next read maps them back); else a no-op."""
        if _MADVISE is None or not self.owns(tensor):
            return
        storage = tensor.untyped_storage()
        _MADVISE(storage.data_ptr(), storage.nbytes(), _MADV_DONTNEED)  # a whole mapping: page-aligned

    def close(self) -> None:
        """Remove the (empty) temporary directory; the mappings stay valid as long as tensors hold them."""
        self._finalizer()

    def __getstate__(self) -> dict[str, Any]:
        """A copy (deepcopy, pickle) holds its codes in RAM: its store starts empty and never releases them."""
        return {"parent_dir": self.parent_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["parent_dir"])  # type: ignore[misc]
