"""Compressed weights in memory-mapped files, resident only while their layer runs (``weights="mmap"``).

MeBP stores the frozen weights compressed and decompresses them lazily; on a phone the compressed
weights themselves are memory-mapped from flash. :class:`MappedWeights` does the same: each
compressed tensor is written once to its own file in a private temporary directory and replaced by
a shared memory map of it. After a layer has decompressed its weight, :meth:`MappedWeights.release`
drops the mapping's pages from the process (``madvise(MADV_DONTNEED)``): the bytes stay in the OS page
cache (or on disk, under memory pressure) and the next use maps them back. The process's resident
set then holds the compressed weights of the layers running now, not of the whole model.

Linux and macOS only (``madvise``); CPU tensors only. The store holds its mappings weakly: they live
as long as the tensors holding them, so a model moved off the CPU (``.to("cuda")``, ``_apply``) drops
them, and with them their pages. A store releases only the mappings it made: a copy of the model
(``copy.deepcopy``, pickle: EMA, SWA) holds its codes as ordinary heap tensors, which it keeps
resident, and a tensor that replaced a mapped one is left alone, since ``MADV_DONTNEED`` on heap pages
would zero them.

The directory must be on a disk: on a RAM file system (tmpfs, a common ``/tmp``) the bytes stay in
RAM, outside the process's RSS, and a warning says so. :func:`maps_at_conversion` and
:func:`maps_for_training` are where ``weights="auto"`` is decided.
"""

from __future__ import annotations

import atexit
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

from lcsb_lightning.mebp._internal.formats import Packed
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
    best: tuple[int, str | None] = (-1, None)
    for mount_point, fs_type in mounts:
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best[0]:
            best = (len(mount_point), fs_type)
    return best[1]


def mmap_supported() -> bool:
    """Whether this platform can release mapped pages (``weights="mmap"``)."""
    return _MADVISE is not None


#: File systems whose files are RAM: mapping them saves nothing.
RAM_FILE_SYSTEMS: tuple[str, ...] = ("tmpfs", "ramfs")


def on_ram_file_system(directory: str | None) -> bool:
    """Whether ``directory`` (the system temp dir for None) is on a RAM file system."""
    return filesystem_type(directory or tempfile.gettempdir()) in RAM_FILE_SYSTEMS


def accelerator_available() -> bool:
    """Whether Lightning's ``accelerator="auto"`` would train on an accelerator here (XLA, MPS, CUDA)."""
    from lightning.fabric.accelerators import CUDAAccelerator, MPSAccelerator, XLAAccelerator

    return any(accelerator.is_available() for accelerator in (XLAAccelerator, MPSAccelerator, CUDAAccelerator))


_auto_reasons_logged: set[str] = set()


def maps_for_training(weights: str, device: torch.device, directory: str | None) -> bool:
    """Whether compressed weights that train on ``device`` go to memory-mapped files (``weights`` is
    ``"auto"``, ``"mmap"`` or ``"ram"``; ``directory`` is ``offload_dir``).

    ``"auto"`` maps them on the CPU where ``madvise`` exists and ``directory`` is on a disk; why it keeps
    CPU weights in RAM is logged once per process and reason.
    """
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
    """Whether ``apply_mebp``/``load_compressed`` map the weights they compress on ``device`` right away.

    ``"mmap"`` maps CPU weights; ``"auto"`` only where they will train where they are: on the CPU of a
    machine without an accelerator (:func:`accelerator_available`). Otherwise ``QuantizedMeBP``
    decides at fit start, when the model is on its training device (:func:`maps_for_training`).
    """
    if weights == "auto" and accelerator_available():
        return False
    return maps_for_training(weights, device, directory)


class MappedWeights:
    """Writes compressed tensors to files and maps them back; see the module docstring.

    Args:
        parent_dir: Where the temporary directory is created (default: the system temp dir).

    Example::

        >>> store = MappedWeights()
        >>> packed = store.map(Packed(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1)))
        >>> store.release(packed.codes)
        >>> int(packed.scales.sum())
        4
        >>> store.close()
    """

    def __init__(self, parent_dir: str | None = None) -> None:
        if not mmap_supported():
            raise OSError(f"`weights='mmap'` needs madvise (Linux or macOS); this is {sys.platform}. Use weights='ram'.")
        self.parent_dir = parent_dir
        self.path = tempfile.mkdtemp(prefix="lcsb_mebp_weights_", dir=parent_dir)
        if filesystem_type(self.path) in ("tmpfs", "ramfs"):
            warnings.warn(
                f"QuantizedMeBP's weights='mmap' directory {self.path} is on a RAM file system: the compressed "
                "weights stay in RAM (as shared memory, outside the process's RSS); set offload_dir to a "
                "directory on a disk.",
                UserWarning,
                stacklevel=3,
            )
        self._counter = itertools.count()
        self.bytes_mapped = 0
        # Each mapping this store made, by start address, held weakly: a mapping lives as long as a
        # tensor holds it, and while it lives no other allocation can have its address.
        self._mappings: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)
        atexit.register(self._finalizer)

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
        mins = self._map_tensor(packed.mins) if packed.mins is not None else None
        return Packed(self._map_tensor(packed.codes), self._map_tensor(packed.scales), mins)

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
        """Drop the resident pages of a mapped tensor (its values stay; the next read maps them back).

        A no-op for a tensor this store did not map (a copy's heap codes, a tensor moved to another
        device): ``MADV_DONTNEED`` would zero its pages and those of its neighbours.
        """
        if _MADVISE is None or not self.owns(tensor):
            return
        storage = tensor.untyped_storage()
        _MADVISE(storage.data_ptr(), storage.nbytes(), _MADV_DONTNEED)  # a whole mapping: page-aligned

    def close(self) -> None:
        """Remove the (empty) temporary directory. The store holds no mapping: each stays valid, and is
        released after use, as long as a tensor holds it."""
        self._finalizer()
        atexit.unregister(self._finalizer)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (deepcopy, pickle) of a model holds its codes in RAM; the store itself starts empty,
        owning no mapping, so it never releases the copy's heap codes."""
        return {"parent_dir": self.parent_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["parent_dir"])  # type: ignore[misc]
