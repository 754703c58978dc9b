"""The process-wide malloc settings: ``map_large_allocations`` says where it has no effect and acts before the
conversion allocates; the heap trims are one mechanism, bounded per forward pass, counted, under one lock, for
compressed and float models alike."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from _mebp_utils import add_lora, tiny_llama, tokens
from lcsb_lightning.mebp import apply_mebp, load_compressed
from lcsb_lightning.mebp._internal import heap


@pytest.fixture
def fresh_heap_state() -> Any:
    heap.map_large_allocations.cache_clear()
    yield
    heap.map_large_allocations.cache_clear()


@pytest.mark.parametrize(("mallopt", "reason"), [
    (None, "the C library is not glibc"),
    (lambda *args: 0, "mallopt\\(M_MMAP_THRESHOLD\\) refused the value"),
])
def test_map_large_allocations_warns_where_it_has_no_effect(monkeypatch: pytest.MonkeyPatch, fresh_heap_state: Any,
                                                            mallopt: Any, reason: str) -> None:
    monkeypatch.setattr(heap, "_glibc", lambda name: mallopt if name == "mallopt" else None)
    monkeypatch.setattr(heap, "_foreign_malloc", lambda: "the C library is not glibc" if mallopt is None else None,
                        raising=False)
    with pytest.warns(UserWarning, match=f"`map_large_allocations=True` has no effect here: {reason}"):
        assert heap.map_large_allocations() is False


def test_a_preloaded_allocator_turns_both_mechanisms_off(monkeypatch: pytest.MonkeyPatch, fresh_heap_state: Any) -> None:
    if heap._foreign_malloc() is not None:
        pytest.skip("not glibc's malloc here")
    reason = "another allocator replaces glibc's malloc (LD_PRELOAD: jemalloc, tcmalloc, ...)"
    monkeypatch.setattr(heap, "_foreign_malloc", lambda: reason)
    heap._glibc.cache_clear()
    try:
        assert not heap.heap_release_supported()
        with pytest.warns(UserWarning, match="has no effect here: another allocator replaces glibc's malloc"):
            assert heap.map_large_allocations() is False
    finally:
        heap._glibc.cache_clear()


@pytest.mark.parametrize("load", [True, False], ids=["load_compressed", "apply_mebp"])
def test_map_large_allocations_acts_before_the_conversion_allocates(monkeypatch: pytest.MonkeyPatch,
                                                                    fresh_heap_state: Any, load: bool) -> None:
    """The threshold applies only to what the heap's free space cannot serve: it must come first."""
    from lcsb_lightning.mebp import loading
    from lcsb_lightning.mebp._internal.stored import StoredFormat

    events: list[str] = []
    monkeypatch.setattr(heap, "_glibc", lambda name: (lambda *args: events.append("mallopt") or 1) if name == "mallopt" else None)
    for module, name in ((StoredFormat, "allocate"), (loading, "_meta_model")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, **k: events.append("allocate") or _f(*a, **k))
    if load:
        load_compressed(tiny_llama(num_layers=1).config, fmt="int4", group_size=32, map_large_allocations=True)
    else:
        apply_mebp(add_lora(tiny_llama(num_layers=1)), fmt="int4", group_size=32, map_large_allocations=True)
    assert events[0] == "mallopt" and "allocate" in events and events.count("mallopt") == 1, events


@pytest.mark.skipif(not heap.heap_release_supported(), reason="glibc only")
def test_the_growth_gated_trims_are_capped_per_forward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "MAX_TRIMS_PER_PASS", 3)
    heap.start_forward_pass()
    start = heap.trim_count()
    trimmed = [heap.trim_heap_if_grown(threshold=0) for _ in range(5)]
    assert trimmed == [True, True, True, False, False] and heap.trim_count() - start == 3
    assert heap.trim_heap() and heap.trim_count() - start == 4  # a trim at a fixed point is not capped
    heap.start_forward_pass()
    assert heap.trim_heap_if_grown(threshold=0)


def _fit(tmp_path: Any, compressed: bool = True, callbacks: list[Any] = ()) -> list[float]:  # type: ignore[assignment]
    """Two steps of a 4-block LoRA model, under ``QuantizedMeBP`` or in float with ``recompute_lower_blocks``:
    ``mebp/heap_trims`` of each step, or the float run's count of trims after each step."""
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lcsb_lightning.mebp import QuantizedMeBP
    from lcsb_lightning.recompute import recompute_lower_blocks

    trims: list[float] = []

    class Lora(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = add_lora(copy.deepcopy(tiny_llama(num_layers=4)))
            if not compressed:
                recompute_lower_blocks(self.model, keep_top=2)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(batch[0], labels=batch[0]).loss

        def on_train_batch_end(self, *args: Any) -> None:
            trims.append(plugins[0].last_metrics["mebp/heap_trims"] if plugins else float(heap.trim_count()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    plugins = [QuantizedMeBP(fmt="int4", group_size=32)] if compressed else []
    Trainer(accelerator="cpu", max_steps=2, plugins=plugins, callbacks=list(callbacks), default_root_dir=tmp_path,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
        Lora(), DataLoader(TensorDataset(tokens(batch=4)), batch_size=2))
    return trims


def _trims_per_step(tmp_path: Any) -> list[float]:
    return _fit(tmp_path)


@pytest.mark.skipif(not heap.heap_release_supported(), reason="glibc only")
def test_the_plugin_counts_the_trims_of_each_step(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "RELEASE_THRESHOLD_BYTES", 0)  # a trim before every block and recompute ...
    monkeypatch.setattr(heap, "MAX_TRIMS_PER_PASS", 5)  # ... 8 a step, but 5 allowed
    assert _trims_per_step(tmp_path)[-1] == 5


@pytest.mark.skipif(not heap.heap_release_supported(), reason="glibc only")
def test_the_first_recompute_of_a_step_trims_whatever_the_growth(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once per step, as the backward starts: what the forward and the loss freed leaves before the backward's
    peak, however few fresh pages the loss touched (under the growth threshold alone it stayed or not by chance)."""
    monkeypatch.setattr(heap, "RELEASE_THRESHOLD_BYTES", 1 << 50)  # no growth ever reaches it
    heap.start_forward_pass()
    assert [heap.trim_heap_before_backward() for _ in range(2)] == [True, False]
    heap.start_forward_pass()
    assert heap.trim_heap_before_backward()
    assert _trims_per_step(tmp_path) == [1, 1]


@pytest.mark.skipif(not heap.heap_release_supported(), reason="glibc only")
def test_heap_trim_trims_under_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every trim goes through the one mechanism: under its lock (the block wrappers' trims may run on another
    thread), counted, setting the growth baseline."""
    from lcsb_lightning.heap_trim import HeapTrim

    locked: list[bool] = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda: lambda pad: locked.append(heap._lock.locked()))
    callback = HeapTrim()
    callback.on_train_batch_end(None, None, None, None, 0)  # type: ignore[arg-type]
    callback.on_validation_start(None, None)  # type: ignore[arg-type]
    assert locked == [True, True]


@pytest.mark.skipif(not heap.heap_release_supported(), reason="glibc only")
def test_the_trims_between_steps_are_counted_in_the_next_step(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mebp/heap_trims`` counts every trim since the previous optimizer step: the first recompute's, and the one
    ``HeapTrim`` made after the previous batch."""
    from lcsb_lightning.heap_trim import HeapTrim

    monkeypatch.setattr(heap, "RELEASE_THRESHOLD_BYTES", 1 << 50)  # no growth ever reaches it
    assert _fit(tmp_path, callbacks=[HeapTrim()]) == [1, 2]


@pytest.mark.skipif(not heap.heap_release_supported(), reason="glibc only")
def test_a_float_model_trims_inside_its_steps_and_between_them(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without compression: ``recompute_lower_blocks``' wrappers trim as the backward's first recompute starts, the
    library's ``HeapTrim`` after each batch, and the one count holds both."""
    from lcsb_lightning import HeapTrim

    monkeypatch.setattr(heap, "RELEASE_THRESHOLD_BYTES", 1 << 50)
    start = heap.trim_count()
    assert [count - start for count in _fit(tmp_path, compressed=False, callbacks=[HeapTrim()])] == [2, 4]
