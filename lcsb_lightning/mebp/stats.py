"""Decompression and recompute timers of one converted model (plain Python, read by its plugin).

Every model :func:`~lcsb_lightning.mebp.apply_mebp` converts gets its own :class:`MeBPStats`
(``mebp_state(model).stats``); its compressed layers and checkpointed blocks report to it, so two
models, plugins or trainers in one process never mix their figures.

Decompression happens either in the forward pass (``"forward"``) or while autograd runs the backward
pass (``"backward"``: the compressed Linear's input-gradient, and every decompression inside a
checkpoint recompute). Recompute time is the wall time of the recomputed block forwards.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator

import torch

_state = threading.local()


def recomputing() -> bool:
    """Whether a checkpointed block is being recomputed in backward on this thread."""
    return getattr(_state, "recompute_depth", 0) > 0


def checkpointed() -> bool:
    """Whether the code runs inside a checkpointed block (its first forward or its recompute)."""
    return getattr(_state, "checkpoint_depth", 0) > 0


@contextlib.contextmanager
def checkpoint_scope(recompute: bool) -> Iterator[None]:
    """Mark the enclosed code as a checkpointed block's forward, or its backward recompute."""
    _state.checkpoint_depth = getattr(_state, "checkpoint_depth", 0) + 1
    _state.recompute_depth = getattr(_state, "recompute_depth", 0) + int(recompute)
    try:
        yield
    finally:
        _state.checkpoint_depth -= 1
        _state.recompute_depth -= int(recompute)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class MeBPStats:
    """Milliseconds and counts accumulated since the last :meth:`reset`.

    Example::

        >>> stats = MeBPStats()
        >>> with stats.time_decompress("forward", torch.device("cpu")):
        ...     _ = torch.ones(4).sum()
        >>> stats.decompress_count["forward"]
        1
    """

    decompress_ms: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    decompress_count: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    recompute_ms: float = 0.0
    backward_ms: float = 0.0
    enabled: bool = True

    def reset(self) -> None:
        for key in self.decompress_ms:
            self.decompress_ms[key] = 0.0
            self.decompress_count[key] = 0
        self.recompute_ms = 0.0
        self.backward_ms = 0.0

    def add_decompress(self, phase: str, ms: float) -> None:
        self.decompress_ms[phase] += ms
        self.decompress_count[phase] += 1

    def add_recompute(self, ms: float) -> None:
        self.recompute_ms += ms

    def time_recompute(self, device: torch.device) -> ContextManager[None]:
        """Time a block's backward recompute (a no-op while ``enabled`` is False)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return _timed_ms(device, self.add_recompute)

    def time_decompress(self, phase: str, device: torch.device) -> ContextManager[None]:
        """Time one decompression in ``phase`` (``"forward"``/``"backward"``; a no-op while disabled)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return _timed_ms(device, lambda ms: self.add_decompress(phase, ms))

    def as_dict(self) -> dict[str, float]:
        """Metrics named ``mebp/...``; ``decompress_share_bwd`` only once a backward was timed."""
        out = {
            "mebp/decompress_fwd_ms": self.decompress_ms["forward"],
            "mebp/decompress_bwd_ms": self.decompress_ms["backward"],
            "mebp/decompress_fwd_count": float(self.decompress_count["forward"]),
            "mebp/decompress_bwd_count": float(self.decompress_count["backward"]),
            "mebp/recompute_ms": self.recompute_ms,
        }
        if self.backward_ms > 0:
            out["mebp/backward_ms"] = self.backward_ms
            out["mebp/decompress_share_bwd"] = self.decompress_ms["backward"] / self.backward_ms
        return out


@contextlib.contextmanager
def _timed_ms(device: torch.device, record: Callable[[float], None]) -> Iterator[None]:
    """Pass the block's wall time in milliseconds to ``record`` (device-synchronised on both ends)."""
    _sync(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        _sync(device)
        record((time.perf_counter() - start) * 1e3)
