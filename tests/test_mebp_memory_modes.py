"""The two lower-memory modes change no number: memory-mapped weights released after use, and
re-decompressing in backward instead of keeping the recompute's weights."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from _mebp_utils import add_lora, lora_grads, tiny_config, tiny_llama, tokens

from lcsb_lightning.mebp import MeBPConfig, apply_mebp, chunked_lm_loss, load_compressed, mebp_state
from lcsb_lightning.mebp.compressed import CompressedLinear

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.model(input_ids=ids).last_hidden_state
    loss = chunked_lm_loss(hidden, causal_lm.get_output_embeddings(), ids, chunk_size=8)
    loss.backward()
    return loss


def _assert_same_training(first: torch.nn.Module, second: torch.nn.Module) -> None:
    ids = tokens()
    assert torch.equal(_step(first, ids), _step(second, ids))
    grads_first, grads_second = lora_grads(first), lora_grads(second)
    assert grads_first.keys() == grads_second.keys() and grads_first
    for name, grad in grads_first.items():
        assert torch.equal(grad, grads_second[name]), name


def _resident_bytes(tensor: torch.Tensor) -> int:
    """``Rss`` of the mapping that holds ``tensor`` (its own file mapping), from /proc/self/smaps."""
    start = tensor.untyped_storage().data_ptr()
    with open("/proc/self/smaps") as handle:
        lines = handle.read().splitlines()
    for index, line in enumerate(lines):
        bounds = line.split(" ", 1)[0]
        if "-" in bounds and all(c in "0123456789abcdef-" for c in bounds):
            low, high = (int(x, 16) for x in bounds.split("-"))
            if low <= start < high:
                rss = next(entry for entry in lines[index + 1 :] if entry.startswith("Rss:"))
                return int(rss.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.parametrize("checkpoint", [True, False])
def test_mmap_weights_train_exactly_like_weights_in_ram(checkpoint: bool) -> None:
    base = add_lora(tiny_llama(num_layers=3))
    ram = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, checkpoint=checkpoint)
    mapped = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, checkpoint=checkpoint, weights="mmap")
    _assert_same_training(mapped, ram)
    state = mebp_state(mapped)
    assert state.weight_store is not None and state.weight_store.bytes_mapped > 0
    state.close()


@linux_only
def test_mmap_weights_are_not_resident_after_their_layer_ran() -> None:
    model = apply_mebp(add_lora(tiny_llama(num_layers=2)), fmt="int4", group_size=32, weights="mmap")
    layers = [m for m in model.modules() if isinstance(m, CompressedLinear)]
    _step(model, tokens())
    codes = layers[0].weight
    assert _resident_bytes(codes) == 0
    codes.sum()  # reading maps the pages back
    assert _resident_bytes(codes) > 0
    layers[0].release_pages()
    assert _resident_bytes(codes) == 0


def test_mmap_weights_on_a_ram_file_system_are_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    from lcsb_lightning.mebp._internal import storage

    monkeypatch.setattr(storage, "filesystem_type", lambda path: "tmpfs")
    with pytest.warns(UserWarning, match=r"is on a RAM file system: the compressed weights stay in RAM"):
        state = mebp_state(apply_mebp(tiny_llama(num_layers=2), fmt="int4", group_size=32, weights="mmap"))
    state.close()


@linux_only
def test_filesystem_type_of_the_root_is_read_from_proc_mounts() -> None:
    from lcsb_lightning.mebp._internal.storage import filesystem_type

    assert filesystem_type("/proc/self") == "proc"


def test_load_compressed_maps_each_tensor_as_it_is_compressed() -> None:
    ram = load_compressed(tiny_config(num_layers=2), fmt="int4", group_size=32)
    mapped = load_compressed(tiny_config(num_layers=2), fmt="int4", group_size=32, weights="mmap")
    for (name, a), (_, b) in zip(ram.named_buffers(), mapped.named_buffers()):
        assert torch.equal(a, b), name
    _assert_same_training(add_lora(mapped), add_lora(ram))


def test_redecompressing_in_backward_gives_the_same_gradients_for_one_more_decompression() -> None:
    base = add_lora(tiny_llama(num_layers=3))
    kept = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32)
    lean = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, keep_recomputed_weights=False)
    _assert_same_training(lean, kept)
    # Above block 0 every Linear's input needs a gradient: kept, the recompute's copy serves the
    # backward; lean, the backward decompresses once more. (Block 0's q/k/v/gate/up see the frozen
    # embedding's output: no input gradient, no backward decompression in either mode.)
    upper = [n for n in mebp_state(kept).compressed_modules if ".layers.1." in n or ".layers.2." in n]
    assert len(upper) == 2 * 7
    for name in upper:
        kept_count = mebp_state(kept).compressed_modules[name].decompress_count
        lean_count = mebp_state(lean).compressed_modules[name].decompress_count
        assert lean_count["backward"] == kept_count["backward"] + 1 == 2, name


@pytest.mark.parametrize("checkpoint", [True, False])
def test_release_heap_trims_around_every_block_and_before_every_recompute(monkeypatch: pytest.MonkeyPatch,
                                                                          checkpoint: bool) -> None:
    from lcsb_lightning.mebp._internal import checkpoint as checkpoint_module

    calls: list[int] = []
    monkeypatch.setattr(checkpoint_module, "trim_heap_if_grown", lambda: calls.append(1))
    monkeypatch.setattr(checkpoint_module, "trim_heap_before_backward", lambda: calls.append(1))
    base = add_lora(tiny_llama(num_layers=3))
    released = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, checkpoint=checkpoint, release_heap=True)
    plain = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, checkpoint=checkpoint, release_heap=False)
    _assert_same_training(released, plain)
    per_block = 3 if checkpoint else 2  # before and after each block's forward, and before its recompute
    assert len(calls) == 3 * per_block
    with torch.no_grad():
        released(tokens())
    assert len(calls) == 3 * per_block  # not while evaluating


@linux_only
def test_the_heap_is_trimmed_only_after_the_resident_set_grew_by_the_threshold() -> None:
    from lcsb_lightning.mebp._internal import heap

    assert heap.heap_release_supported()
    heap.trim_heap()
    heap.start_forward_pass()
    assert not heap.trim_heap_if_grown(threshold=1 << 40)
    grown = torch.ones(32 << 20, dtype=torch.uint8)  # 32 MiB, touched: resident
    assert heap.trim_heap_if_grown(threshold=16 << 20)
    assert not heap.trim_heap_if_grown(threshold=16 << 20)  # nothing grew since
    del grown


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"weights": "disk"}, ValueError, r"`weights='disk'` is not supported; choose one of 'auto', 'mmap', 'ram'"),
        ({"keep_recomputed_weights": "no"}, TypeError, r"`keep_recomputed_weights` must be a bool, got 'no'"),
        ({"release_heap": 1}, TypeError, r"`release_heap` must be a bool, got 1"),
    ],
)
def test_memory_mode_arguments_are_checked_before_any_work(kwargs: dict, error: type, match: str) -> None:
    from lcsb_lightning.mebp import QuantizedMeBP

    model = tiny_llama(num_layers=2)
    with pytest.raises(error, match=match):
        apply_mebp(model, fmt="int4", group_size=32, **kwargs)
    with pytest.raises(error, match=match):
        QuantizedMeBP(fmt="int4", **kwargs)
    assert mebp_state(model) is None


def test_map_large_allocations_fixes_the_mmap_threshold_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from lcsb_lightning.mebp import load_compressed
    from lcsb_lightning.mebp._internal import heap

    if not heap.heap_release_supported():
        pytest.skip("glibc only")
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(heap, "_glibc", lambda name: (lambda *args: calls.append(args) or 1) if name == "mallopt" else (lambda *args: 0))
    heap.map_large_allocations.cache_clear()
    load_compressed(tiny_llama(num_layers=1).config, fmt="int4", group_size=32)  # off by default
    assert calls == []
    load_compressed(tiny_llama(num_layers=1).config, fmt="int4", group_size=32, map_large_allocations=True)
    apply_mebp(add_lora(tiny_llama(num_layers=1)), fmt="int4", group_size=32, map_large_allocations=True)
    assert calls == [(heap._M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD_BYTES)]  # once per process
    heap.map_large_allocations.cache_clear()


@pytest.mark.parametrize(("device", "supported", "filesystem", "mapped"), [
    ("cpu", True, "ext4", True), ("cpu", False, "ext4", False), ("cpu", True, "tmpfs", False), ("cuda", True, "ext4", False),
])
def test_weights_auto_maps_them_only_for_cpu_training_on_a_disk(monkeypatch: pytest.MonkeyPatch, device: str,
                                                                supported: bool, filesystem: str, mapped: bool) -> None:
    from lcsb_lightning.mebp._internal import storage

    monkeypatch.setattr(storage, "mmap_supported", lambda: supported)
    monkeypatch.setattr(storage, "filesystem_type", lambda path: filesystem)
    assert MeBPConfig(fmt="int4").weights == "auto"  # kept as given, decided where the device is known
    assert storage.maps_for_training("auto", torch.device(device), None) is mapped
    assert storage.maps_for_training("ram", torch.device(device), None) is False
