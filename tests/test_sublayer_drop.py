"""Sublayer drop (DropBP): the gradients are DropBP's detach, in the set-ups users fine-tune with; the policy's draws,
allocation and state; the controller and callback glue; bad input."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lcsb_lightning import LCSBCallback
from lcsb_lightning.blocks import map_trainable_params
from lcsb_lightning.controller import LCSBController
from lcsb_lightning.policies import DropBPPolicy, allocate_drop_rates
from lcsb_lightning.sublayers import (
    SublayerDrop, find_sublayers, first_example, measure_sensitivity, sequence_length, sublayer_flops, sublayer_params,
)
from tests.conftest import TokenLM, token_batches, tiny_llama_peft

NUM_BLOCKS = 4
DROPPED = (1, 2, 7)  # block 0's MLP, block 1's attention, block 3's MLP
KEPT = tuple(i for i in range(2 * NUM_BLOCKS) if i not in DROPPED)


def _lora() -> nn.Module:
    return tiny_llama_peft(num_layers=NUM_BLOCKS)


def _input_grads() -> nn.Module:
    model = _lora()
    model.enable_input_require_grads()
    return model


def _checkpointing(reentrant: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = _lora()
        model.train()
        model.base_model.model.activation_checkpointing_enable({"use_reentrant": reentrant})
        return model

    return make


SETUPS: dict[str, Callable[[], nn.Module]] = {
    "lora": _lora,
    "enable_input_require_grads": _input_grads,
    "checkpointing_non_reentrant": _checkpointing(False),
    "checkpointing_reentrant": _checkpointing(True),
}


def _loss(model: nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    return model(input_ids=tokens, labels=tokens).loss


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _detach_output(module: nn.Module, args: Any, output: Any) -> Any:
    """DropBP's own drop: the sublayer's output detached before the residual add."""
    return (output[0].detach(), *output[1:]) if isinstance(output, tuple) else output.detach()


def _units(model: nn.Module) -> list[nn.Module]:
    return sublayer_params(map_trainable_params(model)).blocks


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_dropped_sublayer_passes_the_gradient_through_the_residual_only(setup: str) -> None:
    model = SETUPS[setup]()
    units = _units(model)
    handles = [units[i].register_forward_hook(_detach_output) for i in DROPPED]
    model.zero_grad(set_to_none=True)
    _loss(model).backward()
    for handle in handles:
        handle.remove()
    reference = _grads(model)

    mapped = sublayer_params(map_trainable_params(model))
    drop = SublayerDrop(mapped.blocks, mapped.params_per_block)
    drop.set_selection(KEPT)
    model.zero_grad(set_to_none=True)
    _loss(model).backward()
    drop.remove()
    grads = _grads(model)

    dropped_names = {n for i in DROPPED for n in mapped.names_per_block[i]}
    kept_names = {n for i in KEPT for n in mapped.names_per_block[i]}
    assert dropped_names and kept_names
    for name in dropped_names:
        assert grads[name] is not None, f"{setup}: {name} got no gradient (plain DDP needs one for every parameter)"
        assert not grads[name].any(), f"{setup}: dropped {name} has a non-zero gradient"
    for name in kept_names:
        assert reference[name] is not None and reference[name].any()
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-7, msg=f"{setup}: {name}")


def test_removing_restores_the_forward_and_full_backprop() -> None:
    model = _lora()
    model.zero_grad(set_to_none=True)
    _loss(model).backward()
    full = _grads(model)
    mapped = sublayer_params(map_trainable_params(model))
    drop = SublayerDrop(mapped.blocks, mapped.params_per_block)
    drop.set_selection(KEPT)
    drop.clear()  # every sublayer kept: full backprop
    model.zero_grad(set_to_none=True)
    _loss(model).backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, full[name], msg=name)
    drop.remove()
    assert all("forward" not in vars(unit) for unit in mapped.blocks)


def test_units_are_each_blocks_attention_then_mlp() -> None:
    model = _lora()
    mapped = sublayer_params(map_trainable_params(model))
    assert mapped.num_blocks == 2 * NUM_BLOCKS
    assert all(".self_attn." in n for n in mapped.names_per_block[2])
    assert all(".layers.1.mlp." in n for n in mapped.names_per_block[3])
    assert sum(map(len, mapped.params_per_block)) == sum(p.requires_grad for p in model.parameters())


def test_a_block_without_sublayers_or_with_a_trainable_norm_is_refused() -> None:
    with pytest.raises(ValueError, match=r"block 3 \(Linear\) has no children"):
        find_sublayers(nn.Linear(2, 2), index=3)
    model = _lora()
    model.base_model.model.model.layers[2].input_layernorm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"block 2 trains 1 outside them \(e.g. .*input_layernorm.weight\)"):
        sublayer_params(map_trainable_params(model))


def test_sublayer_flops_count_linear_layers_and_attention_scores() -> None:
    model = _lora()
    attention, mlp = find_sublayers(model.base_model.model.model.layers[0])
    # hidden 32, 4 heads of 8, 2 kv heads: q 32x32, k and v 32x16, o 32x32; LoRA r=4 on each (in*4 + 4*out)
    frozen = 32 * 32 + 2 * 32 * 16 + 32 * 32
    lora = sum(i * 4 + 4 * o for i, o in [(32, 32), (32, 16), (32, 16), (32, 32)])
    assert sublayer_flops(attention, seq_len=10, attention=True) == frozen + lora + 2 * 10 * 32
    assert sublayer_flops(mlp, seq_len=10, attention=False) == 3 * 32 * 64 + sum(
        i * 4 + 4 * o for i, o in [(32, 64), (32, 64), (64, 32)]
    )


def test_measured_sensitivity_is_dropbps_and_leaves_grad_and_selection_alone() -> None:
    model = _lora()
    mapped = sublayer_params(map_trainable_params(model))
    drop = SublayerDrop(mapped.blocks, mapped.params_per_block)
    drop.set_selection(KEPT)
    sensitivity = measure_sensitivity(lambda: _loss(model), drop, mapped.params_per_block)
    assert drop.selected == KEPT
    assert all(p.grad is None for p in model.parameters())
    # by hand for unit 5: sum over parameters of (|g| - |g without unit 5|)^2
    flat = [p for ps in mapped.params_per_block for p in ps]
    drop.clear()
    reference = [g.norm() for g in torch.autograd.grad(_loss(model), flat)]
    drop.set_selection(i for i in range(2 * NUM_BLOCKS) if i != 5)
    without = [g.norm() for g in torch.autograd.grad(_loss(model), flat)]
    drop.remove()
    assert sensitivity[5] == pytest.approx(float(sum((a - b) ** 2 for a, b in zip(reference, without))), rel=1e-5)
    assert len(sensitivity) == 2 * NUM_BLOCKS and all(s > 0 for s in sensitivity)


@pytest.mark.parametrize(
    ("sensitivity", "flops", "drop_rate", "rates"),
    [
        ([1.0, 4.0], [1.0, 1.0], 0.5, [0.8, 0.2]),        # the less sensitive unit drops more
        ([1.0, 1.0], [1.0, 1.0], 0.5, [0.5, 0.5]),        # equal sensitivities share the budget
        ([0.0, 5.0, 5.0], [1.0, 1.0, 1.0], 0.3, [0.9, 0.0, 0.0]),  # capped at 0.9
        ([1.0, 1.0], [3.0, 1.0], 0.5, [0.5, 0.5]),        # FLOPs enter the budget only, as in DropBP
        ([2.0, 1.0], [1.0, 1.0], 0.0, [0.0, 0.0]),
    ],
)
def test_allocation_is_dropbps_greedy(sensitivity: list[float], flops: list[float], drop_rate: float, rates: list[float]) -> None:
    got = allocate_drop_rates(sensitivity, flops, drop_rate)
    assert got == pytest.approx(rates)
    assert sum(f * (1 - r) for f, r in zip(flops, got)) <= (1 - drop_rate) * sum(flops) + 1e-9


def test_allocation_errors() -> None:
    with pytest.raises(ValueError, match="2 sensitivities for 3 FLOP counts"):
        allocate_drop_rates([1.0, 1.0], [1.0, 1.0, 1.0], 0.5)
    with pytest.raises(ValueError, match=r"`drop_rate=0.95` cannot be met"):
        allocate_drop_rates([1.0], [1.0], 0.95)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"drop_rate": 1.0}, r"`drop_rate` must be in \[0, 1\), got 1.0"),
        ({"drop_rate": -0.1}, r"`drop_rate` must be in \[0, 1\), got -0.1"),
        ({"allocation": "greedy"}, r"`allocation='greedy'` is not supported; allowed: uniform, sensitivity"),
        ({"allocation": "sensitivity", "drop_rate": 0.95}, r"must be <= 0.9"),
        ({"sensitivity_at": 1.0}, r"`sensitivity_at` must be in \[0, 1\), got 1.0"),
        ({"switch_every": 0}, r"`switch_every` must be an integer >= 1, got 0"),
    ],
)
def test_policy_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DropBPPolicy(**kwargs)


def test_the_callback_builds_dropbp_by_name() -> None:
    callback = LCSBCallback("dropbp", seed=2)
    assert isinstance(callback.policy, DropBPPolicy) and callback.policy.seed == 2 and callback.policy.drop_rate == 0.5
    with pytest.raises(ValueError, match=r"`layers_per_step=4` sizes the policies .*; 'dropbp' takes none"):
        LCSBCallback("dropbp", layers_per_step=4)


def test_draws_drop_at_least_the_rate_each_step_and_each_unit_at_its_rate() -> None:
    policy = DropBPPolicy(drop_rate=0.5, seed=3)
    policy.setup(num_blocks=60)
    kept = [policy.select(t) for t in range(400)]
    assert all(len(k) <= 30 for k in kept)  # DropBP's top-up: never fewer than drop_rate of the units dropped
    share = [sum(i in k for k in kept) / len(kept) for i in range(60)]
    assert 0.3 < min(share) and max(share) < 0.6  # every unit is kept about half of the time
    again = DropBPPolicy(drop_rate=0.5, seed=3)
    again.setup(num_blocks=60)
    assert [again.select(t) for t in range(400)] == kept


def test_allocated_rates_steer_the_draws() -> None:
    policy = DropBPPolicy(drop_rate=0.5, allocation="sensitivity", seed=0)
    policy.setup(num_blocks=4)
    assert policy.needs_sensitivity
    rates = policy.allocate([1.0, 1.0, 50.0, 50.0], [1.0] * 4)
    assert rates == pytest.approx([0.9, 0.9, 0.1, 0.1]) and not policy.needs_sensitivity
    kept = [policy.select(t) for t in range(200)]
    assert sum(2 in k for k in kept) > 150 and sum(0 in k for k in kept) < 40


def test_policy_state_round_trip_continues_the_draws() -> None:
    def make() -> DropBPPolicy:
        p = DropBPPolicy(drop_rate=0.4, allocation="sensitivity", seed=1)
        p.setup(num_blocks=8)
        return p

    first = make()
    first.allocate([float(i + 1) for i in range(8)], [1.0] * 8)
    [first.select(t) for t in range(5)]
    state = first.state_dict()
    expected = [first.select(t) for t in range(5, 15)]
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.rates == first.rates and not resumed.needs_sensitivity
    assert [resumed.select(t) for t in range(5, 15)] == expected


def test_first_example_and_sequence_length() -> None:
    batch = {"input_ids": torch.zeros(4, 7, dtype=torch.long), "labels": torch.ones(4, 7), "n": 3, "scale": torch.ones(2)}
    one = first_example(batch)
    assert one["input_ids"].shape == (1, 7) and one["labels"].shape == (1, 7) and one["n"] == 3
    assert one["scale"].shape == (2,)  # not the batch's leading size: kept whole
    assert first_example([torch.zeros(3, 5)])[0].shape == (1, 5)
    assert sequence_length(batch) == 7 and sequence_length({"x": 1}) == 1


def test_controller_drops_sublayers_and_gives_dropped_ones_zeros() -> None:
    model = _lora()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    controller = LCSBController(model, DropBPPolicy(drop_rate=0.5, seed=0))
    try:
        assert controller.num_blocks == 2 * NUM_BLOCKS
        kept = controller.begin_step(0)
        assert kept is not None and len(kept) <= NUM_BLOCKS  # no all_reached widening for sublayers
        _loss(model).backward()
        controller.before_optimizer_step(optimizer)
        for i, params in enumerate(controller.block_params.params_per_block):
            for p in params:
                assert p.grad is not None and bool(p.grad.any()) == (i in kept)
    finally:
        controller.release()


@pytest.mark.parametrize("backward", ["identity", "selected_only"])
def test_a_block_backward_with_a_sublayer_policy_is_refused(backward: str) -> None:
    with pytest.raises(ValueError, match=rf"`backward='{backward}'` applies to block policies; DropBPPolicy"):
        LCSBController(_lora(), DropBPPolicy(), backward=backward)


class _Kept(Callback):
    """Records the sublayers each step kept."""

    def __init__(self) -> None:
        self.kept: list[tuple[int, ...]] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.kept.append(trainer.callbacks[0].selection)


def test_callback_allocates_by_sensitivity_once_and_a_resumed_run_continues_exactly(tmp_path: Any) -> None:
    def fit(steps: int, ckpt: str | None = None, save: bool = False) -> tuple[TokenLM, _Kept, LCSBCallback]:
        module = TokenLM(tiny_llama_peft(num_layers=NUM_BLOCKS), lr=0.02)
        callback = LCSBCallback(DropBPPolicy(drop_rate=0.5, allocation="sensitivity", seed=0))  # after step 1 of 4 and of 12
        kept = _Kept()
        callbacks: list[Callback] = [callback, kept]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4))
        trainer = Trainer(max_steps=steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=save)
        trainer.fit(module, token_batches(num_batches=4, vocab=64), ckpt_path=ckpt)
        return module, kept, callback

    whole, whole_kept, callback = fit(12)
    assert isinstance(callback.policy, DropBPPolicy) and callback.policy.allocated
    assert callback.policy.rates != [0.5] * 8 and len(whole_kept.kept) == 12
    # the module's losses: 12 steps and the 9 forwards of the sensitivity (8 units and the reference)
    assert len(whole.losses) == 12 + 2 * NUM_BLOCKS + 1
    fit(4, save=True)
    resumed, resumed_kept, resumed_callback = fit(12, ckpt=str(tmp_path / "last.ckpt"))
    assert resumed_callback.policy.rates == callback.policy.rates  # restored, not measured again
    assert resumed_kept.kept == whole_kept.kept[4:]
    assert resumed.losses == whole.losses[-8:]


def test_under_quantized_mebp_the_gradients_are_dropbps_too() -> None:
    from lcsb_lightning.mebp import QuantizedMeBP

    module = TokenLM(tiny_llama_peft(num_layers=NUM_BLOCKS))
    QuantizedMeBP(fmt="int4", group_size=32, compress_embeddings=False).convert_module(module)
    model = module.model
    model.train()
    units = _units(model)
    handles = [units[i].register_forward_hook(_detach_output) for i in DROPPED]
    model.zero_grad(set_to_none=True)
    _loss(model).backward()
    for handle in handles:
        handle.remove()
    reference = _grads(model)
    mapped = sublayer_params(map_trainable_params(model))
    drop = SublayerDrop(mapped.blocks, mapped.params_per_block)
    drop.set_selection(KEPT)
    model.zero_grad(set_to_none=True)
    _loss(model).backward()
    drop.remove()
    grads = _grads(model)
    for i in range(2 * NUM_BLOCKS):
        for name in mapped.names_per_block[i]:
            if i in DROPPED:
                assert grads[name] is not None and not grads[name].any(), name
            else:
                torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-7, msg=name)


def test_every_sensitivity_pass_sees_the_same_random_draws_and_the_training_stream_is_left_alone() -> None:
    model = tiny_llama_peft(num_layers=2, lora_dropout=0.5)
    model.train()  # the LoRA dropout is active
    mapped = sublayer_params(map_trainable_params(model))
    drop = SublayerDrop(mapped.blocks, mapped.params_per_block)
    torch.manual_seed(3)
    first = measure_sensitivity(lambda: _loss(model), drop, mapped.params_per_block)
    after_first = torch.rand(4)
    torch.manual_seed(3)
    assert measure_sensitivity(lambda: _loss(model), drop, mapped.params_per_block) == first
    torch.manual_seed(3)
    assert torch.equal(torch.rand(4), after_first)  # measuring drew nothing from the training's stream
    # DropBP seeds every pass alike: a unit's sensitivity is the change its drop makes, not the dropout's noise
    flat = [p for ps in mapped.params_per_block for p in ps]

    def norms(dropped: int | None) -> list[torch.Tensor]:
        drop.set_selection(i for i in range(4) if i != dropped)
        torch.manual_seed(3)
        return [g.norm() for g in torch.autograd.grad(_loss(model), flat)]

    reference, without = norms(None), norms(2)
    drop.remove()
    assert first[2] == pytest.approx(float(sum((a - b) ** 2 for a, b in zip(reference, without))), rel=1e-5)


def test_sublayer_flops_count_gpt2s_conv1d_layers() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, n_positions=16, vocab_size=64))
    attention, mlp = find_sublayers(model.transformer.h[0])
    assert sublayer_flops(mlp, seq_len=8, attention=False) == 2 * 32 * 128  # c_fc 32x128, c_proj 128x32
    assert sublayer_flops(attention, seq_len=8, attention=True) == 32 * 96 + 32 * 32 + 2 * 8 * 32


def _fit_dropbp(tmp_path: Any, policy: DropBPPolicy, *callbacks: Callback, module: TokenLM | None = None,
                **trainer_kwargs: Any) -> tuple[TokenLM, Trainer]:
    module = module or TokenLM(tiny_llama_peft(num_layers=NUM_BLOCKS), lr=0.02)
    trainer = Trainer(callbacks=[LCSBCallback(policy), *callbacks], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False,
                      **{"max_steps": 6, **trainer_kwargs})
    trainer.fit(module, token_batches(num_batches=4, vocab=64))
    return module, trainer


def test_a_state_restored_after_fit_start_is_not_measured_again(tmp_path: Any) -> None:
    """FSDP and ModelParallelStrategy restore a checkpoint after the callbacks' on_fit_start."""
    rates = [0.9, 0.1, 0.9, 0.1, 0.5, 0.5, 0.0, 0.9]
    policy = DropBPPolicy(allocation="sensitivity", seed=0)

    class RestoreLate(Callback):
        def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
            lcsb = trainer.callbacks[0]
            state = lcsb.state_dict()
            state["policy"] = {**state["policy"], "rates": rates, "allocated": True}
            lcsb.load_state_dict(state)

    module, _ = _fit_dropbp(tmp_path, policy, RestoreLate())
    assert policy.rates == rates and len(module.losses) == 6  # no measurement: 6 training forwards only


def test_sensitivity_allocation_in_a_run_of_unknown_length_is_refused_at_fit_start(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"allocation='sensitivity'.*after `sensitivity_at=0.1` of the run's steps.*"
                                         r"set `max_steps`"):
        _fit_dropbp(tmp_path, DropBPPolicy(allocation="sensitivity"), max_steps=-1, max_epochs=-1)


class _AutocastLM(TokenLM):
    """Records, at each forward of its training step, whether CPU autocast is on."""

    def __init__(self) -> None:
        super().__init__(tiny_llama_peft(num_layers=NUM_BLOCKS), lr=0.02)
        self.autocast: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        return super().training_step(batch, batch_idx)


def test_the_sensitivity_is_measured_in_the_training_precision(tmp_path: Any) -> None:
    module, _ = _fit_dropbp(tmp_path, DropBPPolicy(allocation="sensitivity", seed=0), module=_AutocastLM(),
                            max_steps=3, precision="bf16-mixed")
    assert len(module.autocast) == 3 + 2 * NUM_BLOCKS + 1 and all(module.autocast)


def test_sublayer_metrics_are_named_by_sublayer(tmp_path: Any) -> None:
    _, trainer = _fit_dropbp(tmp_path, DropBPPolicy(drop_rate=0.5, seed=0), max_steps=2)
    names = [k.split("/")[-1] for k in trainer.logged_metrics if k.startswith("lcsb/grad_norm/")]
    assert names and all(n[:5] == "attn_" or n[:4] == "mlp_" for n in names)
    assert set(names) <= {f"{kind}_{b:02d}" for kind in ("attn", "mlp") for b in range(NUM_BLOCKS)}
