"""Decompression buffers are reused without changing a single gradient; timers belong to one model."""

from __future__ import annotations

import copy

import pytest
import torch
from _mebp_utils import add_lora, lora_grads, tiny_llama, tokens

from lcsb_lightning.mebp import CompressedLinear, apply_mebp, chunked_lm_loss, mebp_state
from lcsb_lightning.mebp._internal.formats import FORMATS, get_format
from lcsb_lightning.mebp._internal.workspace import DecompressionWorkspace


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dequantize_into_a_buffer_equals_the_allocating_path(fmt: str, dtype: torch.dtype) -> None:
    stored = get_format(fmt)
    packed = stored.quantize(torch.randn(48, 128, generator=torch.Generator().manual_seed(0)), 64)
    out = torch.full((48, 128), float("nan"), dtype=dtype)
    index = torch.empty(48, 64, dtype=torch.int32)
    result = stored.dequantize(packed, 64, dtype, out=out, index_buffer=index)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(result, stored.dequantize(packed, 64, dtype))


def test_dequantize_rejects_a_buffer_of_the_wrong_shape() -> None:
    packed = get_format("int4").quantize(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match=r"`out` must be a \(8, 64\) tensor of torch.float32, got \(8, 32\)"):
        get_format("int4").dequantize(packed, 32, torch.float32, out=torch.empty(8, 32))


def test_workspace_lends_the_smallest_free_buffer_that_fits() -> None:
    workspace = DecompressionWorkspace(max_free_per_key=2)
    cpu = torch.device("cpu")
    small, large = workspace.borrow((4, 8), torch.float32, cpu), workspace.borrow((16, 8), torch.float32, cpu)
    workspace.give_back(small)
    workspace.give_back(large)
    assert workspace.free_bytes() == (32 + 128) * 4
    reused = workspace.borrow((2, 16), torch.float32, cpu)  # 32 elements: the small buffer
    assert reused.shape == (2, 16) and reused.data_ptr() == small.data_ptr()
    assert workspace.borrow((8, 8), torch.float32, cpu).data_ptr() == large.data_ptr()
    assert workspace.borrow((8, 8), torch.float64, cpu).dtype == torch.float64  # another dtype: allocated
    assert (workspace.allocations, workspace.reuses) == (3, 2)
    workspace.give_back(reused)
    workspace.give_back(reused)  # twice: kept once
    assert workspace.free_bytes() == 32 * 4
    assert copy.deepcopy(workspace).free_bytes() == 0
    with pytest.raises(ValueError, match="`max_free_per_key` must be >= 1, got 0"):
        DecompressionWorkspace(0)


def test_workspace_keeps_at_most_max_free_per_key_dropping_the_smallest() -> None:
    workspace = DecompressionWorkspace(max_free_per_key=1)
    cpu = torch.device("cpu")
    small, large = workspace.borrow((4,), torch.float32, cpu), workspace.borrow((16,), torch.float32, cpu)
    workspace.give_back(large)
    workspace.give_back(small)
    assert workspace.free_bytes() == 16 * 4


def test_a_foreign_tensor_given_back_is_ignored_and_an_alias_returns_its_buffer() -> None:
    """Autograd may hand back a detached alias of a lent weight, and the mmap offload a copy loaded
    from disk (seen in a recipe run: a 2-D foreign tensor was pooled and broke the next borrow)."""
    workspace = DecompressionWorkspace()
    cpu = torch.device("cpu")
    workspace.give_back(torch.empty(64, 64))  # not lent by this workspace
    assert workspace.free_bytes() == 0
    lent = workspace.borrow((32, 64), torch.float32, cpu)
    workspace.give_back(lent.detach())
    assert workspace.free_bytes() == 32 * 64 * 4
    again = workspace.borrow((16, 8), torch.float32, cpu)
    assert again.shape == (16, 8) and again.data_ptr() == lent.data_ptr()


def test_a_buffer_never_given_back_is_freed_with_its_borrower() -> None:
    workspace = DecompressionWorkspace()
    lent = workspace.borrow((8, 8), torch.float32, torch.device("cpu"))
    del lent  # a dropped graph
    assert len(workspace._lent) == 0 and workspace.free_bytes() == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_with_a_scratch_of_fewer_rows_than_the_weight(fmt: str) -> None:
    stored = get_format(fmt)
    packed = stored.quantize(torch.randn(50, 128, generator=torch.Generator().manual_seed(1)), 64)
    out, index = torch.empty(50, 128), torch.empty(7, 64, dtype=torch.int32)
    assert torch.equal(stored.dequantize(packed, 64, torch.float32, out=out, index_buffer=index),
                       stored.dequantize(packed, 64, torch.float32))


def _step(model: torch.nn.Module, ids: torch.Tensor, retain: bool = False) -> torch.Tensor:
    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=ids).last_hidden_state
    loss = chunked_lm_loss(hidden, causal_lm.get_output_embeddings(), ids, chunk_size=8)
    loss.backward(retain_graph=retain)
    return loss


@pytest.mark.parametrize("checkpoint", [True, False])
def test_gradients_are_bit_identical_with_and_without_the_workspace(checkpoint: bool) -> None:
    base = add_lora(tiny_llama(num_layers=3))
    pooled = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, checkpoint=checkpoint)
    plain = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, checkpoint=checkpoint)
    for layer in mebp_state(plain).compressed_modules.values():
        layer.workspace = None
    workspace = mebp_state(pooled).workspace
    for step in range(2):
        ids = tokens(seed=step)
        assert torch.equal(_step(pooled, ids), _step(plain, ids))
        assert lora_grads(pooled).keys() == lora_grads(plain).keys()
        for name, grad in lora_grads(pooled).items():
            assert torch.equal(grad, lora_grads(plain)[name]), name
        if step == 0:
            allocations = workspace.allocations
    assert workspace.allocations == allocations, "the second step allocated decompression buffers again"
    assert workspace.reuses > 0


def test_a_retained_graph_backpropagated_twice_never_reads_a_reused_buffer() -> None:
    base = add_lora(tiny_llama(num_layers=2))
    model = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, checkpoint=False)
    reference = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, checkpoint=False)
    ids = tokens()
    causal_lm = model.get_base_model()
    loss = chunked_lm_loss(causal_lm.model(input_ids=ids).last_hidden_state, causal_lm.lm_head, ids)
    loss.backward(retain_graph=True)
    loss.backward()
    _step(reference, ids)
    for name, grad in lora_grads(model).items():
        torch.testing.assert_close(grad, 2 * lora_grads(reference)[name], rtol=1e-6, atol=1e-7)


def test_two_models_in_one_process_keep_their_own_timers() -> None:
    first = apply_mebp(add_lora(tiny_llama(num_layers=2)), fmt="int4", group_size=32)
    second = apply_mebp(add_lora(tiny_llama(num_layers=2)), fmt="int4", group_size=32)
    _step(first, tokens())
    stats_first, stats_second = mebp_state(first).stats, mebp_state(second).stats
    # block Linears, the embedding, the LM head once per loss chunk (30 shifted tokens in chunks of 8)
    assert stats_first.decompress_count["forward"] == 2 * 7 + 1 + 4 and stats_first.recompute_ms > 0
    assert stats_second.decompress_count == {"forward": 0, "backward": 0} and stats_second.recompute_ms == 0
    assert stats_first is not stats_second and mebp_state(first).workspace is not mebp_state(second).workspace
    layer = next(m for m in first.modules() if isinstance(m, CompressedLinear))
    assert layer.stats is stats_first


def test_a_disabled_timer_records_nothing() -> None:
    model = apply_mebp(add_lora(tiny_llama(num_layers=2)), fmt="int4", group_size=32)
    stats = mebp_state(model).stats
    stats.enabled = False
    _step(model, tokens())
    assert stats.as_dict()["mebp/decompress_fwd_count"] == 0 and stats.recompute_ms == 0


def test_one_weight_at_a_time_keeps_one_free_buffer_that_serves_every_layer() -> None:
    """``keep_recomputed_weights=False`` decompresses one weight at a time, so one buffer (the largest weight's)
    serves them all; a pool of one buffer per weight size held 3.3 MB more at the 0.5B shape's peak."""
    model = apply_mebp(add_lora(tiny_llama(num_layers=3)), fmt="int4", group_size=32, keep_recomputed_weights=False)
    workspace = mebp_state(model).workspace
    for step in range(3):
        _step(model, tokens(seed=step))
        if step == 0:
            allocations = workspace.allocations
    by_dtype = [buffer.dtype for buffer in workspace.buffers()]
    assert sorted(map(str, by_dtype)) == ["torch.float32", "torch.int32"]  # the weights' and the code lookup's
    assert workspace.allocations == allocations, "a later step allocated decompression buffers again"


def test_weights_kept_from_the_recompute_keep_a_buffer_per_lent_weight() -> None:
    """The defaults lend every Linear of a block at once (recompute to backward): one buffer would not do."""
    model = apply_mebp(add_lora(tiny_llama(num_layers=3)), fmt="int4", group_size=32)
    workspace = mebp_state(model).workspace
    _step(model, tokens())
    allocations = workspace.allocations
    _step(model, tokens(seed=1))
    assert sum(buffer.is_floating_point() for buffer in workspace.buffers()) > 1
    assert workspace.allocations == allocations
