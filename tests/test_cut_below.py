"""Below the lowest selected block the backward does no work, in the set-ups users fine-tune with.

Each case counts, per block, the gradients autograd computed inside it (a tensor hook on every
Linear output), and compares the gradients of the blocks that train with full backprop's.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from lcsb_lightning.blocks import map_trainable_params
from lcsb_lightning.controller import LCSBController
from lcsb_lightning.policies import CyclicPolicy
from lcsb_lightning.selective import SelectiveBackprop
from tests.conftest import tiny_llama_peft

NUM_BLOCKS = 4
SELECTION = (2, 3)


def _tiny_llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_BLOCKS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _lora() -> nn.Module:
    return tiny_llama_peft(num_layers=NUM_BLOCKS)


def _input_grads() -> nn.Module:
    model = _lora()
    model.enable_input_require_grads()
    return model


def _trainable_embedding() -> nn.Module:
    model = _lora()
    model.get_input_embeddings().weight.requires_grad_(True)
    return model


def _checkpointing(reentrant: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = _lora()
        model.train()
        # what a user calls (transformers 5 names it activation_checkpointing_enable); it also calls
        # enable_input_require_grads
        model.base_model.model.activation_checkpointing_enable({"use_reentrant": reentrant})
        return model

    return make


def _full_fine_tuning() -> nn.Module:
    model = _tiny_llama()
    model.train()
    return model


SETUPS: dict[str, Callable[[], nn.Module]] = {
    "lora": _lora,
    "enable_input_require_grads": _input_grads,
    "trainable_embedding": _trainable_embedding,
    "checkpointing_non_reentrant": _checkpointing(False),
    "checkpointing_reentrant": _checkpointing(True),
    "full_fine_tuning": _full_fine_tuning,
}


class BackwardCounter:
    """Counts, per block, the gradients computed for the outputs of the block's Linear layers."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.counts = [0] * len(blocks)
        self.handles = []
        for index, block in enumerate(blocks):
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    self.handles.append(module.register_forward_hook(self._hook(index)))

    def _hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if output.requires_grad:
                output.register_hook(lambda grad: self._count(index))

        return hook

    def _count(self, index: int) -> None:
        self.counts[index] += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _loss(model: nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    return model(input_ids=tokens, labels=tokens).loss


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _backward(model: nn.Module, selection: tuple[int, ...] | None) -> tuple[list[int], dict[str, torch.Tensor | None]]:
    mapped = map_trainable_params(model)
    selective = SelectiveBackprop(mapped.blocks, mapped.params_per_block, "selected_only")
    if selection is not None:
        selective.set_selection(selection)
    counter = BackwardCounter(mapped.blocks)
    try:
        model.zero_grad(set_to_none=True)
        _loss(model).backward()
    finally:
        counter.remove()
        selective.remove()
    return counter.counts, _grads(model)


def _block_of(name: str) -> int | None:
    marker = ".layers."
    if marker not in name:
        return None
    return int(name.split(marker, 1)[1].split(".", 1)[0])


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_no_backward_below_the_selection(setup: str) -> None:
    model = SETUPS[setup]()
    full_counts, full_grads = _backward(model, None)
    assert all(count > 0 for count in full_counts), full_counts
    counts, grads = _backward(model, SELECTION)
    assert counts[: min(SELECTION)] == [0] * min(SELECTION), f"{setup}: backward ran below the selection: {counts}"
    lowest = min(SELECTION)
    # the lowest selected block computes no gradient for its input's frozen projections: less than full
    assert 0 < counts[lowest] <= full_counts[lowest]
    assert counts[lowest + 1 :] == full_counts[lowest + 1 :]
    for name, grad in grads.items():
        block = _block_of(name)
        assert grad is not None, f"{setup}: {name} got no gradient (plain DDP needs one for every parameter)"
        if block is not None and block in SELECTION:
            torch.testing.assert_close(grad, full_grads[name], rtol=1e-5, atol=1e-7, msg=f"{setup}: {name}")
        elif block is not None or "embed_tokens" in name:  # below the selection: an exact zero
            assert not grad.any(), f"{setup}: {name} below the selection has a non-zero gradient"


@pytest.mark.parametrize("setup", ["trainable_embedding", "full_fine_tuning"])
def test_what_lies_below_trains_when_the_backward_reaches_it(setup: str) -> None:
    model = SETUPS[setup]()
    _, full_grads = _backward(model, None)
    counts, grads = _backward(model, tuple(range(NUM_BLOCKS)))
    embedding = next(n for n in grads if "embed_tokens" in n)
    assert grads[embedding] is not None and grads[embedding].any()
    torch.testing.assert_close(grads[embedding], full_grads[embedding], rtol=1e-5, atol=1e-7)


def test_input_that_requires_grad_gets_no_gradient_below_the_selection() -> None:
    model = _lora()
    embeds = model.get_input_embeddings()(torch.randint(0, 64, (2, 12))).detach().requires_grad_()
    mapped = map_trainable_params(model)
    selective = SelectiveBackprop(mapped.blocks, mapped.params_per_block, "selected_only")
    selective.set_selection(SELECTION)
    model(inputs_embeds=embeds).logits.sum().backward()
    selective.remove()
    assert embeds.grad is None


@pytest.mark.parametrize(
    ("unreached", "embedding_gets", "block_gets"), [("implicit", "zeros", "zeros"), ("skip_below", "nothing", "zeros")]
)
def test_controller_gives_the_embedding_zero_or_no_gradient_on_steps_that_do_not_reach_it(
    unreached: str, embedding_gets: str, block_gets: str
) -> None:
    model = _trainable_embedding()
    embedding = model.get_input_embeddings().weight
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    controller = LCSBController(model, CyclicPolicy(layers_per_step=2), backward="selected_only", unreached=unreached)
    lowest_block_lora = controller.block_params.params_per_block[0][0]
    try:
        assert controller.begin_step(0) == (0, 1)  # reaches the embedding
        _loss(model).backward()
        controller.before_optimizer_step(optimizer)
        assert embedding.grad is not None and embedding.grad.any()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert controller.begin_step(1) == (2, 3)
        _loss(model).backward()
        assert embedding.grad is not None and not embedding.grad.any()  # exact zeros: plain DDP is served
        assert controller.selective is not None and [id(p) for p in controller.selective.params_below] == [id(embedding)]
        controller.before_optimizer_step(optimizer)
        for tensor, gets in ((embedding, embedding_gets), (lowest_block_lora, block_gets)):
            if gets == "zeros":
                assert tensor.grad is not None and not tensor.grad.any()
            else:
                assert tensor.grad is None
        before = embedding.detach().clone()
        optimizer.step()
        # implicit: AdamW's momentum moves it (and touches every weight); skip_below: the optimizer leaves it alone
        assert torch.equal(embedding, before) == (embedding_gets == "nothing")
    finally:
        controller.release()


def _tied_lora_with_trainable_embedding() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_BLOCKS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,  # as SmolLM2, Qwen2.5-0.5B, Gemma
    )
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    model.get_input_embeddings().weight.requires_grad_(True)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return model


@pytest.mark.parametrize("unreached", ["implicit", "skip_below"])
def test_a_tied_embedding_keeps_its_head_gradient_on_steps_that_do_not_reach_it(unreached: str) -> None:
    model = _tied_lora_with_trainable_embedding()
    weight = model.get_input_embeddings().weight
    # reference: the head's share of the tied weight's gradient alone (the lookup's share is cut off)
    hook = model.get_input_embeddings().register_forward_hook(lambda module, args, out: out.detach())
    _loss(model).backward()
    hook.remove()
    head_share = weight.grad.clone()
    assert head_share.any()
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    controller = LCSBController(model, CyclicPolicy(layers_per_step=2), unreached=unreached)
    try:
        assert controller.begin_step(1) == (2, 3)  # does not reach the embedding lookup
        _loss(model).backward()
        controller.before_optimizer_step(optimizer)
        assert weight.grad is not None
        torch.testing.assert_close(weight.grad, head_share)
    finally:
        controller.release()


class _OuterReentrantNet(nn.Module):
    """A user's model that wraps each block call in a reentrant checkpoint itself."""

    def __init__(self) -> None:
        super().__init__()
        from tests.conftest import ResidualNet

        torch.manual_seed(0)
        self.net = ResidualNet(num_blocks=NUM_BLOCKS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.net.embed(tokens).requires_grad_()
        for block in self.net.stack:
            h = checkpoint(block, h, use_reentrant=True)
        return self.net.head(h)


def test_reentrant_checkpoint_outside_the_block_warns_once_and_stays_exact() -> None:
    model = _OuterReentrantNet()
    tokens = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    model(tokens).sum().backward()
    full = _grads(model)
    model.zero_grad(set_to_none=True)
    mapped = map_trainable_params(model)
    selective = SelectiveBackprop(mapped.blocks, mapped.params_per_block, "selected_only")
    selective.set_selection(SELECTION)
    with pytest.warns(UserWarning, match="cannot cut block") as record:
        model(tokens).sum().backward()
        model(tokens).sum().backward()
    selective.remove()
    assert sum("cannot cut" in str(w.message) for w in record) == 1
    for name, grad in _grads(model).items():
        if f"stack.{SELECTION[0]}." in name:
            torch.testing.assert_close(grad, 2 * full[name])
