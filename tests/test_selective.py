"""Gradient semantics of the identity path (LCSB's backward) and of the exact mode, and what they cost."""

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


def _surrogate_hooks(blocks: list[nn.Module], selection: tuple[int, ...]) -> list:
    """The paper's definition, written independently: h + stop_grad(f(h) - h) for skipped blocks."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output):
        h = args[0] if args else kwargs["hidden_states"]
        o = output if isinstance(output, torch.Tensor) else output[0]
        new = h + (o - h).detach()
        return new if isinstance(output, torch.Tensor) else (new, *output[1:])

    return [b.register_forward_hook(hook, with_kwargs=True) for i, b in enumerate(blocks) if i not in selection]


def _selective(model: nn.Module, backward: str = "identity") -> SelectiveBackprop:
    mapped = map_trainable_params(model)
    return SelectiveBackprop(mapped.blocks, mapped.params_per_block, backward)


def _surrogate_vs_selective(
    model: nn.Module, loss_fn: Callable[[], torch.Tensor], selection: tuple[int, ...]
) -> tuple[float, dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]]:
    """Backward once through the hook-based surrogate, once through SelectiveBackprop.

    Returns the SelectiveBackprop loss, its gradients and the surrogate's gradients."""
    blocks = map_trainable_params(model).blocks
    hooks = _surrogate_hooks(blocks, selection)
    loss_fn().backward()
    expected = _grads(model)
    for hook in hooks:
        hook.remove()
    model.zero_grad(set_to_none=True)
    selective = _selective(model)
    selective.set_selection(selection)
    loss = loss_fn()
    loss.backward()
    selective.remove()
    return loss.item(), _grads(model), expected


MODELS: dict[str, Callable[[], nn.Module]] = {
    "plain": lambda: (torch.manual_seed(0), ResidualNet(num_blocks=4))[1],
    "llama_peft": lambda: tiny_llama_peft(num_layers=4),
}


def _is_zero(grad: torch.Tensor | None) -> bool:
    return grad is not None and not grad.any()


@pytest.mark.parametrize("selection", SELECTIONS, ids=str)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_identity_path_matches_surrogate(kind: str, selection: tuple[int, ...]) -> None:
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(1))
    model = MODELS[kind]()
    full_loss = _loss(model, tokens)
    loss, got, expected = _surrogate_vs_selective(model, lambda: _loss(model, tokens), selection)
    assert loss == full_loss.item()  # exact forward value, bit for bit
    mapped = map_trainable_params(model)
    assert all(p.requires_grad for params in mapped.params_per_block for p in params)  # never toggled
    for i, names in enumerate(mapped.names_per_block):
        for name in names:
            if i in selection:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7)
            else:  # an exact zero, not None: AdamW keeps moving it ("implicit updates")
                assert _is_zero(got[name]), f"{name} of skipped block {i}: {got[name]}"


@pytest.mark.parametrize("selection", SELECTIONS, ids=str)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_selected_only_mode_gives_full_backprop_grads(kind: str, selection: tuple[int, ...]) -> None:
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(2))
    model = MODELS[kind]()
    _loss(model, tokens).backward()
    full = _grads(model)
    model.zero_grad(set_to_none=True)
    selective = _selective(model, backward="selected_only")
    selective.set_selection(selection)
    _loss(model, tokens).backward()
    selective.remove()
    got = _grads(model)
    for i, names in enumerate(map_trainable_params(model).names_per_block):
        for name in names:
            if i >= min(selection):  # selected, or passing the gradient down to a selected block
                torch.testing.assert_close(got[name], full[name], rtol=1e-5, atol=1e-7)
            else:  # below every selected block: cut, nothing computed
                assert _is_zero(got[name]), f"{name} of block {i} below the selection: {got[name]}"


@pytest.mark.parametrize("backward", ["identity", "selected_only"])
def test_cut_blocks_save_nothing_and_the_lowest_selected_computes_no_input_grad(backward: str) -> None:
    torch.manual_seed(0)
    model = ResidualNet(num_blocks=4)
    tokens = torch.randint(0, 16, (2, 6))
    selective = _selective(model, backward)
    selective.set_selection([2])
    saved: list[torch.Size] = []
    seen: list[bool] = []
    model.stack[2].register_forward_pre_hook(lambda module, args: seen.append(args[0].requires_grad))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        h = model.embed(tokens)
        for block in model.stack[:2]:
            h = block(h)
    assert saved == []  # blocks 0 and 1 are cut: no activation kept for backward
    model(tokens).sum().backward()
    assert seen == [False]  # block 2 gets an input that needs no gradient: none is computed for it
    assert all(_is_zero(p.grad) for p in model.stack[0].parameters())  # and yet block 0 got its zeros
    selective.remove()


def test_eval_is_untouched_and_removal_restores_the_forward() -> None:
    torch.manual_seed(0)
    model = ResidualNet(num_blocks=4)
    tokens = torch.randint(0, 16, (2, 6))
    selective = _selective(model)
    with torch.no_grad():
        selective.set_selection([0])
        a = model(tokens)
        selective.clear()
        b = model(tokens)
    assert torch.equal(a, b)
    selective.remove()
    selective.remove()  # idempotent
    assert all("forward" not in vars(b) for b in model.stack)


def test_in_place_ops_on_a_skipped_output_work_and_stay_exact() -> None:
    torch.manual_seed(0)
    model = ResidualNet(num_blocks=3)
    tokens = torch.randint(0, 16, (2, 6))
    h0 = model.embed(tokens).requires_grad_(True)
    with torch.no_grad():
        expected = model.stack[0](h0) * 2 + 1
    selective = _selective(model)
    selective.set_selection([1])
    out = model.stack[0](h0)
    out.mul_(2).add_(1)  # raised "is a view and is being modified inplace" before
    assert torch.equal(out, expected)
    model.stack[1](out).sum().backward()
    assert h0.grad is not None
    selective.remove()


def test_identity_path_errors() -> None:
    selective = SelectiveBackprop([nn.Linear(4, 3)])
    selective.set_selection([])
    with pytest.raises(ValueError, match="needs a residual block"):
        selective.blocks[0](torch.randn(2, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match="Linear already has the forward wrapper 'lcsb_selective' installed"):
        SelectiveBackprop(selective.blocks)
    with pytest.raises(ValueError, match=r"`backward='approx'` is not supported; allowed: identity, selected_only\.$"):
        SelectiveBackprop(selective.blocks, backward="approx")


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
    trained = [n for n in got if got[n] is not None and got[n].any()]
    assert trained and all(".h.1." in n or ".layers.1." in n for n in trained)
    for name in trained:  # the surrogate's h + (o - h) rounds differently from o: a looser tolerance
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)


def _controller_grads(model: nn.Module, backward: str, step: int, ids: torch.Tensor) -> tuple[tuple[int, ...], list[list[torch.Tensor]]]:
    """The gradients LCSB hands the optimizer at ``step`` of a layer-cyclic k=1 run: per block, per parameter."""
    from lcsb_lightning.controller import LCSBController
    from lcsb_lightning.policies import CyclicPolicy

    controller = LCSBController(model, CyclicPolicy(layers_per_step=1), backward=backward)
    blocks = controller.block_params.params_per_block
    optimizer = torch.optim.AdamW([p for params in blocks for p in params], lr=1e-3)
    selection = controller.begin_step(step)
    model(input_ids=ids, labels=ids).loss.backward()
    controller.before_optimizer_step(optimizer)
    controller.release()
    return selection, [[p.grad.clone() for p in params] for params in blocks]


@pytest.mark.parametrize("step", [1, 2], ids=lambda s: f"selects_block_{s}")
def test_selected_only_trains_only_the_selected_block_and_all_reached_every_block_above_it(step: int) -> None:
    """Cyclic k=1 at step 1 or 2 selects a middle block: not a top range, so the two backward modes
    differ. The backward runs the same from the top down to the selected block in both;
    ``selected_only`` keeps the selected block's gradient only, ``all_reached`` also the exact gradients
    of the blocks above."""
    import copy

    base = tiny_llama_peft(num_layers=4)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
    reference = copy.deepcopy(base)  # full backprop, LCSB never installed
    reference(input_ids=ids, labels=ids).loss.backward()
    full = [[p.grad for p in params] for params in map_trainable_params(reference).params_per_block]
    exact_sel, exact = _controller_grads(copy.deepcopy(base), "selected_only", step, ids)
    trunc_sel, trunc = _controller_grads(copy.deepcopy(base), "all_reached", step, ids)
    assert exact_sel == (step,) and trunc_sel == tuple(range(step, 4))
    # the selected block: the same computation in both modes, bit for bit, and the exact gradient
    assert all(torch.equal(a, b) for a, b in zip(exact[step], trunc[step]))
    for got, want in zip(exact[step], full[step]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for block in range(step + 1, 4):  # above it: selected_only drops the gradients, all_reached keeps them (exact)
        assert all(not g.any() for g in exact[block]), f"selected_only trained block {block} above its selection"
        assert all(g.any() for g in trunc[block]), f"all_reached left block {block} untrained"
        for got, want in zip(trunc[block], full[block]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for block in range(step):  # below it: cut in both, zero gradients
        assert all(not g.any() for g in exact[block]) and all(not g.any() for g in trunc[block])


def test_dyadic_selections_are_top_ranges_that_all_reached_leaves_unchanged() -> None:
    """Why the benchmark's dyadic arms (recorded with ``backward: exact``, now ``selected_only``) are the
    default's (``all_reached``): each dyadic selection is already the top range that ``all_reached``
    would make of it."""
    from lcsb_lightning.controller import LCSBController
    from lcsb_lightning.policies import DyadicPolicy

    model = tiny_llama_peft(num_layers=8)
    selections = {}
    for mode in ("selected_only", "all_reached"):
        controller = LCSBController(model, DyadicPolicy(levels=3), backward=mode)
        selections[mode] = [controller.begin_step(step) for step in range(8)]
        controller.release()
    assert selections["selected_only"] == selections["all_reached"]
    assert [len(s) for s in selections["selected_only"]] == [8, 2, 4, 2, 8, 2, 4, 2]
    assert all(s == tuple(range(8 - len(s), 8)) for s in selections["selected_only"])


def test_parameters_added_to_the_optimizer_mid_run_get_the_non_selected_treatment() -> None:
    from lcsb_lightning.controller import LCSBController
    from lcsb_lightning.policies import CyclicPolicy

    model = tiny_llama_peft()
    controller = LCSBController(model, CyclicPolicy(layers_per_step=1), backward="selected_only")
    blocks = controller.block_params.params_per_block
    optimizer = torch.optim.AdamW(list(blocks[0]), lr=1e-3)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    for step, added in ((0, None), (1, blocks[2])):  # step 1 selects block 1; block 2 joins the optimizer
        if added is not None:
            optimizer.add_param_group({"params": list(added)})
        controller.begin_step(step)
        model(input_ids=ids, labels=ids).loss.backward()
        controller.before_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=False)
    model(input_ids=ids, labels=ids).loss.backward()
    controller.before_optimizer_step(optimizer)  # still step 1: block 2 is in the optimizer and not selected
    assert all(p.grad is not None and not p.grad.any() for p in blocks[2])  # not theirs to use: zeros
    controller.release()
