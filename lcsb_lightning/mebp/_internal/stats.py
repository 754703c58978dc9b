"""Decompression and recompute timers of one converted model (``mebp_state(model).stats``), read by its plugin.

On CPU they read the wall clock; on CUDA they record event pairs read once per optimizer step (a pair the GPU
has not reached yet counts in the next read), never stalling the device unless ``sync_timing=True``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator

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


_TimedKey = str  # what a timed region adds to: a decompression phase, or one of these attributes
_RECOMPUTE, _BACKWARD = "recompute_ms", "backward_ms"


@dataclass
class MeBPStats:
    """Milliseconds and counts since the last :meth:`reset`; decompressions in ``"forward"`` or in
    ``"backward"`` (input gradients and every decompression inside a recompute).

    Args:
        enabled: Time decompressions and recomputes (``False``: the timers are no-ops).
        sync_timing: Synchronise the device before and after every timed region.
    """

    decompress_ms: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    decompress_count: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    recompute_ms: float = 0.0
    backward_ms: float = 0.0
    enabled: bool = True
    sync_timing: bool = False
    # CUDA event pairs recorded but not read yet, and finished events for reuse.
    _pending: list[tuple[_TimedKey, Any, Any]] = field(default_factory=list, init=False, repr=False, compare=False)
    _spare_events: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("enabled", "sync_timing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")

    def __getstate__(self) -> dict[str, Any]:
        """A copy (deepcopy, pickle: EMA, SWA) leaves out the unread CUDA events, which cannot be copied."""
        return {**self.__dict__, "_pending": [], "_spare_events": []}

    def reset(self) -> None:
        """Zero the totals (event pairs the device has not reached yet count after the reset)."""
        for key in self.decompress_ms:
            self.decompress_ms[key], self.decompress_count[key] = 0.0, 0
        self.recompute_ms = self.backward_ms = 0.0

    def _add_ms(self, key: _TimedKey, ms: float) -> None:
        if key in self.decompress_ms:
            self.decompress_ms[key] += ms
        else:
            setattr(self, key, getattr(self, key) + ms)

    def time_recompute(self, device: torch.device) -> ContextManager[None]:
        """Time a block's backward recompute (a no-op while ``enabled`` is False)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return self._timed(device, _RECOMPUTE)

    def time_decompress(self, phase: str, device: torch.device) -> ContextManager[None]:
        """Time one decompression in ``phase`` (``"forward"``/``"backward"``; a no-op while disabled)."""
        if not self.enabled:
            return contextlib.nullcontext()
        self.decompress_count[phase] += 1
        return self._timed(device, phase)

    def time_backward(self, device: torch.device) -> ContextManager[None]:
        """Time a whole backward pass into :attr:`backward_ms` (timed even while disabled)."""
        return self._timed(device, _BACKWARD)

    @contextlib.contextmanager
    def _timed(self, device: torch.device, key: _TimedKey) -> Iterator[None]:
        if device.type == "cuda" and not self.sync_timing:
            start, end = self._event(), self._event()
            stream = torch.cuda.current_stream(device)
            start.record(stream)
            try:
                yield
            finally:
                end.record(stream)
                self._pending.append((key, start, end))
            return
        if self.sync_timing:
            _sync(device)
        begin = time.perf_counter()
        try:
            yield
        finally:
            if self.sync_timing:
                _sync(device)
            self._add_ms(key, (time.perf_counter() - begin) * 1e3)

    def _event(self) -> Any:
        return self._spare_events.pop() if self._spare_events else torch.cuda.Event(enable_timing=True)

    def collect(self) -> None:
        """Add the event pairs the device has finished to the totals, without waiting for the others."""
        waiting = []
        for key, start, end in self._pending:
            if end.query():
                self._add_ms(key, start.elapsed_time(end))
                self._spare_events += (start, end)
            else:
                waiting.append((key, start, end))
        self._pending = waiting

    def as_dict(self) -> dict[str, float]:
        """Metrics named ``mebp/...``; ``decompress_share_bwd`` only once a backward was timed."""
        self.collect()
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
