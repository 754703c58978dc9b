"""Gradient semantics of the identity path (LCSB's backward) and of plain requires_grad toggling."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from lcsb_lightning.blocks import map_trainable_params
from lcsb_lightning.selective import SelectiveBackprop
from tests.conftest import ResidualNet, tiny_llama_peft

SELECTIONS = [(0,), (1,), (2,), (3,), (0, 2), (1, 3), (0, 1, 2, 3)]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def _set_trainable(model: nn.Module, selection: tuple[int, ...]) -> None:
    for i, params in enumerate(map_trainable_params(model).params_per_block):
        for p in params:
            p.requires_grad_(i in selection)


def _surrogate_hooks(blocks: list[nn.Module], selection: tuple[int, ...]) -> list:
    """The paper's definition, written independently: h + stop_grad(f(h) - h) for skipped blocks."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output):
        h = args[0] if args else kwargs["hidden_states"]
        o = output if isinstance(output, torch.Tensor) else output[0]
        new = h + (o - h).detach()
        return new if isinstance(output, torch.Tensor) else (new, *output[1:])

    return [b.register_forward_hook(hook, with_kwargs=True) for i, b in enumerate(blocks) if i not in selection]


def _surrogate_vs_selective(
    model: nn.Module, loss_fn: Callable[[], torch.Tensor], selection: tuple[int, ...]
) -> tuple[float, dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]]:
    """Backward once through the hook-based surrogate, once through SelectiveBackprop.

    Returns the SelectiveBackprop loss, its gradients and the surrogate's gradients."""
    blocks = map_trainable_params(model).blocks
    _set_trainable(model, selection)
    hooks = _surrogate_hooks(blocks, selection)
    loss_fn().backward()
    expected = _grads(model)
    for hook in hooks:
        hook.remove()
    model.zero_grad(set_to_none=True)
    selective = SelectiveBackprop(blocks)
    selective.set_selection(selection)
    loss = loss_fn()
    loss.backward()
    selective.remove()
    return loss.item(), _grads(model), expected


MODELS: dict[str, Callable[[], nn.Module]] = {
    "plain": lambda: (torch.manual_seed(0), ResidualNet(num_blocks=4))[1],
    "llama_peft": lambda: tiny_llama_peft(num_layers=4),
}


@pytest.mark.parametrize("selection", SELECTIONS, ids=str)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_identity_path_matches_surrogate(kind: str, selection: tuple[int, ...]) -> None:
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(1))
    model = MODELS[kind]()
    full_loss = _loss(model, tokens)
    loss, got, expected = _surrogate_vs_selective(model, lambda: _loss(model, tokens), selection)
    assert loss == full_loss.item()  # exact forward value, bit for bit
    mapped = map_trainable_params(_restore(model))
    for i, names in enumerate(mapped.names_per_block):
        for name in names:
            if i in selection:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7)
            else:
                assert got[name] is None, f"{name} of skipped block {i} received a gradient"


def _restore(model: nn.Module) -> nn.Module:
    for name, p in model.named_parameters():
        if "lora_" in name or ("stack" in name):
            p.requires_grad_(True)
    return model


@pytest.mark.parametrize("selection", SELECTIONS, ids=str)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_exact_mode_gives_full_backprop_grads(kind: str, selection: tuple[int, ...]) -> None:
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(2))
    model = MODELS[kind]()
    _loss(model, tokens).backward()
    full = _grads(model)
    model.zero_grad(set_to_none=True)
    _set_trainable(model, selection)
    _loss(model, tokens).backward()
    got = _grads(model)
    mapped = map_trainable_params(_restore(model))
    for i, names in enumerate(mapped.names_per_block):
        for name in names:
            if i in selection:
                torch.testing.assert_close(got[name], full[name], rtol=1e-5, atol=1e-7)
            else:
                assert got[name] is None


def test_skipped_block_saves_nothing_and_eval_is_untouched() -> None:
    torch.manual_seed(0)
    model = ResidualNet(num_blocks=4)
    tokens = torch.randint(0, 16, (2, 6))
    selective = SelectiveBackprop(model.stack)
    selective.set_selection([3])
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        h = model.embed(tokens)
        for block in model.stack[:3]:
            h = block(h)
    assert saved == []  # blocks 0-2 are skipped: no activation kept for backward
    with torch.no_grad():
        selective.set_selection([0])
        a = model(tokens)
        selective.clear()
        b = model(tokens)
    assert torch.equal(a, b)
    selective.remove()
    assert all("forward" not in vars(b) for b in model.stack)


def test_identity_path_errors() -> None:
    selective = SelectiveBackprop([nn.Linear(4, 3)])
    selective.set_selection([])
    with pytest.raises(ValueError, match="needs a residual block"):
        selective.blocks[0](torch.randn(2, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match="already has selective backprop installed"):
        SelectiveBackprop(selective.blocks)


@pytest.mark.parametrize("arch", ["falcon", "gemma3", "gpt2", "gpt_neox", "opt", "phi3", "qwen2"])
def test_identity_path_on_hf_architectures(arch: str) -> None:
    """Tensor and tuple block outputs, rotary embeddings and masks passed as kwargs."""
    from peft import LoraConfig, get_peft_model

    from tests.test_blocks import ARCHITECTURES

    torch.manual_seed(0)
    make_config, model_cls = ARCHITECTURES[arch]
    model = get_peft_model(model_cls(make_config()), LoraConfig(r=2, target_modules="all-linear", init_lora_weights="gaussian"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    model.train()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def seeded_loss() -> torch.Tensor:  # GPT-2/OPT/Falcon apply dropout in training mode
        torch.manual_seed(123)
        return _loss(model, tokens)

    with torch.no_grad():
        reference = seeded_loss().item()
    loss, got, expected = _surrogate_vs_selective(model, seeded_loss, (1,))
    assert loss == pytest.approx(reference, rel=1e-6)
    trained = [n for n in got if got[n] is not None]
    assert trained and all(".h.1." in n or ".layers.1." in n for n in trained)
    for name in trained:  # the surrogate's h + (o - h) rounds differently from o: a looser tolerance
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)


def test_stacked_forward_wrappers_unwind_to_the_original() -> None:
    """LCSB over QuantizedMeBP's block wrapper (one shared mechanism): removal restores each layer."""
    from lcsb_lightning.forward_wrap import has_wrapper
    from lcsb_lightning.mebp.checkpoint import WRAPPER_ATTR, install_block_wrappers, remove_block_wrappers

    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    install_block_wrappers(blocks, checkpoint_blocks=True)
    selective = SelectiveBackprop(blocks)
    assert not has_wrapper(blocks[0], WRAPPER_ATTR)  # LCSB's wrapper is outermost now
    selective.remove()
    assert has_wrapper(blocks[0], WRAPPER_ATTR)
    remove_block_wrappers(blocks)
    assert all("forward" not in vars(b) for b in blocks)
