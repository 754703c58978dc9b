"""recompute_lower_blocks: the same gradients, fewer stored activations, composed with LCSB."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lcsb_lightning import LCSBCallback
from lcsb_lightning.recompute import recompute_lower_blocks
from tests.conftest import TokenLM, quiet_trainer, tiny_llama_peft, token_batches


def _grads_and_saved_bytes(keep_top: int | None) -> tuple[dict[str, torch.Tensor], int]:
    model = tiny_llama_peft(num_layers=4)
    if keep_top != "unwrapped":
        recompute_lower_blocks(model, keep_top=keep_top)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return grads, saved


@pytest.mark.parametrize("keep_top", [None, 1, 2, 3, 4, 9])
def test_gradients_equal_those_of_the_model_without_recompute(keep_top: int | None) -> None:
    expected, _ = _grads_and_saved_bytes("unwrapped")  # type: ignore[arg-type]
    grads, _ = _grads_and_saved_bytes(keep_top)
    assert grads.keys() == expected.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=name)


def test_blocks_below_the_top_keep_top_store_no_activations() -> None:
    _, all_kept = _grads_and_saved_bytes(None)
    _, top_two = _grads_and_saved_bytes(2)
    _, top_one = _grads_and_saved_bytes(1)
    assert all_kept > top_two > top_one  # a checkpointed block's activations are not saved in forward
    assert _grads_and_saved_bytes(4)[1] == all_kept


@pytest.mark.parametrize(("keep_top", "recomputed"), [(None, 0), (1, 3), (3, 1), (4, 0), (10, 0)])
def test_returns_the_blocks_that_recompute(keep_top: int | None, recomputed: int) -> None:
    model = tiny_llama_peft(num_layers=4)
    lower = recompute_lower_blocks(model, keep_top=keep_top)
    assert lower == list(model.base_model.model.model.layers)[:recomputed]


@pytest.mark.parametrize("keep_top", [0, -1, 1.5, True, "2"])
def test_keep_top_must_be_a_positive_integer(keep_top: Any) -> None:
    with pytest.raises(ValueError, match=r"`keep_top` must be None or an integer >= 1, got"):
        recompute_lower_blocks(tiny_llama_peft(num_layers=2), keep_top=keep_top)


def test_applying_it_twice_is_refused() -> None:
    model = tiny_llama_peft(num_layers=2)
    recompute_lower_blocks(model, keep_top=1)
    with pytest.raises(RuntimeError, match="already carry a per-block checkpoint"):
        recompute_lower_blocks(model, keep_top=1)


def _lora_after_fit(keep_top: int | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = tiny_llama_peft(num_layers=8)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    if keep_top is not None:
        recompute_lower_blocks(model, keep_top=keep_top)
    module = TokenLM(model, lr=5e-3)
    trainer = quiet_trainer(max_steps=4, callbacks=[LCSBCallback(log_every_n_steps=0)])
    trainer.fit(module, token_batches(num_batches=8, vocab=64))
    return before, {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def test_lcsb_steps_train_the_same_weights_with_the_lower_blocks_recomputed() -> None:
    # dyadic depths 8, 2, 4, 2: keep_top=3 recomputes blocks in the first and third steps
    before, expected = _lora_after_fit(None)
    _, trained = _lora_after_fit(3)
    assert trained.keys() == expected.keys() and len(trained) > 0
    for name, value in trained.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    lowest = [name for name in trained if ".layers.0." in name]
    assert lowest and all(not torch.equal(trained[name], before[name]) for name in lowest)  # reached and trained


@pytest.mark.parametrize(("keep_activations", "recomputed"), [
    ("null", [False] * 4), ("1", [True, True, True, False]), ("3", [True, False, False, False]), ("5", [False] * 4)])
def test_the_recipe_recomputes_the_blocks_below_keep_activations(keep_activations: str, recomputed: list[bool]) -> None:
    from _recipes_utils import FAST, compose_cfg

    from lcsb_lightning.blocks import find_blocks
    from lcsb_lightning.forward_wrap import get_wrapper
    from lcsb_lightning.mebp._internal.checkpoint import CHECKPOINT_WRAPPER
    from lcsb_lightning.recipes.train import prepare

    module = prepare(compose_cfg([*FAST, f"keep_activations={keep_activations}"])).module
    wrappers = [get_wrapper(block, CHECKPOINT_WRAPPER) for block in find_blocks(module.model)]
    assert [wrapper.checkpoint_blocks for wrapper in wrappers] == recomputed  # type: ignore[union-attr]


def test_every_forward_pass_trims_again_after_the_per_step_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without QuantizedMeBP nobody starts a step's count of trims: a float run stopped trimming inside its steps
    # once the per-step cap of trims was spent (the main job's peaks grew from 1.1 to 1.4 GB over 80 steps).
    from lcsb_lightning.mebp._internal import heap

    if not heap.heap_release_supported():
        pytest.skip("glibc's malloc_trim is needed")
    monkeypatch.setattr(heap, "RELEASE_THRESHOLD_BYTES", 0)
    monkeypatch.setattr(heap, "MAX_TRIMS_PER_PASS", 3)
    model = tiny_llama_peft(num_layers=4)
    recompute_lower_blocks(model, keep_top=2)
    tokens = torch.randint(0, 64, (2, 16))
    per_pass = []
    for _ in range(4):
        before = heap.trim_count()
        model(input_ids=tokens, labels=tokens).loss.backward()
        per_pass.append(heap.trim_count() - before)
    assert per_pass == [3, 3, 3, 3]
