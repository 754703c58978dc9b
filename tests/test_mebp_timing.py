"""MeBP's timers do not stall the device unless asked (``sync_timing``).

No GPU is needed: ``torch.cuda.synchronize``, ``torch.cuda.Event`` and ``torch.cuda.current_stream``
are replaced by fakes, and the timers are handed ``torch.device("cuda")``.
"""

from __future__ import annotations

import copy
import itertools
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _mebp_utils import add_lora, tiny_llama

from lcsb_lightning.mebp import MeBPConfig, QuantizedMeBP
from lcsb_lightning.mebp._internal.stats import MeBPStats

CUDA = torch.device("cuda")


class FakeEvent:
    """A timing event whose ``record`` reads a clock that advances by 1 ms per record."""

    clock = itertools.count()
    created: list[FakeEvent] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        self.done = True
        FakeEvent.created.append(self)

    def record(self, stream: Any = None) -> None:
        assert stream == "stream"
        self.at = float(next(FakeEvent.clock))

    def query(self) -> bool:
        return self.done

    def __reduce__(self) -> Any:
        raise RuntimeError("a CUDA event cannot be copied or pickled")  # as torch.cuda.Event without IPC

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None and end.done, "read before the GPU got there"
        return end.at - self.at


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """The devices ``torch.cuda.synchronize`` was called with."""
    synced: list[torch.device] = []
    FakeEvent.clock, FakeEvent.created = itertools.count(), []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    return synced


def test_cuda_timers_use_events_read_at_logging_time_and_never_synchronize(fake_cuda: list) -> None:
    stats = MeBPStats()
    with stats.time_backward(CUDA):  # records at 0 and 5
        with stats.time_decompress("forward", CUDA):  # 1, 2
            pass
        with stats.time_recompute(CUDA):  # 3, 4
            pass
    assert fake_cuda == []
    metrics = stats.as_dict()
    assert fake_cuda == []
    assert metrics["mebp/decompress_fwd_ms"] == 1.0 and metrics["mebp/decompress_fwd_count"] == 1.0
    assert metrics["mebp/recompute_ms"] == 1.0 and metrics["mebp/backward_ms"] == 5.0
    assert metrics["mebp/decompress_share_bwd"] == 0.0
    stats.reset()
    with stats.time_decompress("backward", CUDA):
        pass
    assert len(FakeEvent.created) == 6  # the read events were reused


def test_an_event_pair_the_gpu_has_not_reached_counts_at_the_next_read(fake_cuda: list) -> None:
    stats = MeBPStats()
    with stats.time_decompress("backward", CUDA):
        pass
    FakeEvent.created[-1].done = False
    first = stats.as_dict()
    assert first["mebp/decompress_bwd_count"] == 1.0 and first["mebp/decompress_bwd_ms"] == 0.0
    stats.reset()
    FakeEvent.created[-1].done = True
    second = stats.as_dict()
    assert second["mebp/decompress_bwd_ms"] == 1.0 and second["mebp/decompress_bwd_count"] == 0.0
    assert fake_cuda == []


def test_sync_timing_synchronizes_around_every_timed_region(fake_cuda: list) -> None:
    stats = MeBPStats(sync_timing=True)
    with stats.time_decompress("forward", CUDA), stats.time_recompute(CUDA), stats.time_backward(CUDA):
        pass
    assert fake_cuda == [CUDA] * 6 and FakeEvent.created == []
    assert stats.as_dict()["mebp/decompress_fwd_count"] == 1.0


def test_cpu_timers_read_the_wall_clock_without_synchronizing(fake_cuda: list) -> None:
    for sync_timing in (False, True):
        stats = MeBPStats(sync_timing=sync_timing)
        with stats.time_backward(torch.device("cpu")), stats.time_decompress("forward", torch.device("cpu")):
            torch.ones(256, 256).matmul(torch.ones(256, 256))
        metrics = stats.as_dict()
        assert metrics["mebp/decompress_fwd_ms"] > 0 and metrics["mebp/backward_ms"] > 0
    assert fake_cuda == [] and FakeEvent.created == []


class _Model:
    def backward(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        self.called = True


@pytest.mark.parametrize("sync_timing", [False, True])
def test_the_plugin_synchronizes_around_backward_only_with_sync_timing(fake_cuda: list, sync_timing: bool) -> None:
    plugin = QuantizedMeBP(fmt="int4", group_size=32, sync_timing=sync_timing)
    plugin.convert_module(add_lora(tiny_llama(num_layers=1)))
    assert plugin.stats.sync_timing is sync_timing
    model = _Model()
    plugin.backward(SimpleNamespace(device=CUDA), model, None)
    assert model.called
    assert fake_cuda == ([CUDA, CUDA] if sync_timing else [])
    assert plugin.stats.as_dict()["mebp/backward_ms"] > 0


def test_timers_with_unread_events_can_be_copied(fake_cuda: list) -> None:
    stats = MeBPStats()
    with stats.time_decompress("forward", CUDA):
        pass
    for duplicate in (copy.deepcopy(stats), pickle.loads(pickle.dumps(stats))):
        assert duplicate.decompress_count == stats.decompress_count
        assert duplicate.as_dict()["mebp/decompress_fwd_ms"] == 0.0  # the events stayed with the original
    assert stats.as_dict()["mebp/decompress_fwd_ms"] == 1.0


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_sync_timing_must_be_a_bool(value: Any) -> None:
    with pytest.raises(TypeError, match=rf"`sync_timing` must be a bool, got {value!r}\."):
        MeBPConfig(fmt="int4", group_size=32, sync_timing=value)
    with pytest.raises(TypeError, match=rf"`sync_timing` must be a bool, got {value!r}\."):
        QuantizedMeBP(fmt="int4", group_size=32, sync_timing=value)  # a keyword is the field's value, None too
    with pytest.raises(TypeError, match=rf"`sync_timing` must be a bool, got {value!r}\."):
        MeBPStats(sync_timing=value)
