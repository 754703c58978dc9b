"""LCSBCallback inside real Trainers: unreached tensors, accumulation, resume, logging, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lcsb_lightning import LCSBCallback
from lcsb_lightning.policies import CyclicPolicy, DyadicPolicy
from tests.conftest import TokenLM, quiet_trainer, tiny_llama_peft, token_batches


class Recorder(Callback):
    """Snapshots the selection and block-0 parameters after every optimizer step."""

    def __init__(self, lcsb: LCSBCallback) -> None:
        self.lcsb = lcsb
        self.selections: list[tuple[int, ...]] = []
        self.block0: list[torch.Tensor] = []
        self.requires_grad_during_fit: list[bool] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.selections.append(self.lcsb.selection)
        block0 = self.lcsb.controller.block_params.params_per_block[0]
        self.block0.append(torch.cat([p.detach().flatten() for p in block0]).clone())


def _fit(model: TokenLM, lcsb: LCSBCallback, steps: int, **trainer_kwargs: Any) -> Recorder:
    recorder = Recorder(lcsb)
    trainer = quiet_trainer(max_steps=steps, callbacks=[lcsb, recorder], **trainer_kwargs)
    trainer.fit(model, token_batches(num_batches=16))
    return recorder


@pytest.mark.parametrize("unreached", ["skip_below", "implicit"])
def test_a_block_outside_the_selection_keeps_moving_with_adamw(residual_net, unreached: str) -> None:
    # 2 blocks, k=1: block 0 trains at steps 0, 2, 4; block 1 at steps 1, 3, 5.
    model = TokenLM(residual_net(num_blocks=2), lr=0.05, weight_decay=0.1)
    lcsb = LCSBCallback("cyclic", layers_per_step=1, backward="identity", unreached=unreached)
    recorder = _fit(model, lcsb, steps=4)
    assert recorder.selections == [(0,), (1,), (0,), (1,)]
    assert not torch.equal(recorder.block0[0], recorder.block0[1])  # its zero gradient: AdamW's implicit update
    optimizer_state = model.trainer.optimizers[0].state
    assert all(p in optimizer_state and len(optimizer_state[p]) > 0 for p in model.model.stack[0].parameters())
    # the model is left as found
    assert all(p.requires_grad for p in model.model.stack.parameters())
    assert all("forward" not in vars(b) for b in model.model.stack)


def test_selection_changes_only_at_optimizer_steps_under_accumulation(residual_net) -> None:
    model = TokenLM(residual_net(num_blocks=4))
    lcsb = LCSBCallback("cyclic", layers_per_step=2, backward="selected_only")
    recorder = _fit(model, lcsb, steps=3, accumulate_grad_batches=2)
    assert recorder.selections == [(0, 1), (0, 1), (2, 3), (2, 3), (0, 1), (0, 1)]
    assert lcsb.selection_counts == [2, 2, 1, 1]


def test_trains_peft_llama_in_an_ordinary_lightning_module() -> None:
    model = TokenLM(tiny_llama_peft(num_layers=4), lr=5e-3)
    lcsb = LCSBCallback("cyclic", fraction=0.5, backward="selected_only", log_every_n_steps=0)
    trainer = quiet_trainer(max_steps=12, callbacks=[lcsb])
    trainer.fit(model, token_batches(num_batches=2, seq=16))
    assert lcsb.selection_counts == [6, 6, 6, 6]
    assert sum(model.losses[-2:]) < sum(model.losses[:2])  # it learns the two repeated batches
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.requires_grad for p in lora)


class EmbeddingRecorder(Callback):
    def __init__(self) -> None:
        self.snapshots: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.snapshots.append(pl_module.model.get_input_embeddings().weight.detach().clone())


@pytest.mark.parametrize(("unreached", "moves_on_steps_that_miss_it"), [("implicit", True), ("skip_below", False)])
def test_unreached_decides_whether_an_embedding_moves_on_steps_that_do_not_reach_it(
    unreached: str, moves_on_steps_that_miss_it: bool
) -> None:
    backbone = tiny_llama_peft(num_layers=4)
    backbone.get_input_embeddings().weight.requires_grad_(True)
    model = TokenLM(backbone, lr=5e-3)
    lcsb = LCSBCallback("cyclic", layers_per_step=2, unreached=unreached, log_every_n_steps=0)
    recorder = EmbeddingRecorder()
    trainer = quiet_trainer(max_steps=4, callbacks=[lcsb, recorder])
    trainer.fit(model, token_batches(num_batches=4, seq=16))
    assert lcsb.controller.unreached == unreached
    moved = [not torch.equal(a, b) for a, b in zip(recorder.snapshots, recorder.snapshots[1:])]
    # steps 0 and 2 select blocks (0, 1) and reach the embedding; steps 1 and 3 select (2, 3) only
    assert moved == [moves_on_steps_that_miss_it, True, moves_on_steps_that_miss_it]


def test_defaults_are_dyadic_with_the_all_reached_backward(residual_net) -> None:
    lcsb = LCSBCallback(log_every_n_steps=0)
    assert type(lcsb.policy).__name__ == "DyadicPolicy" and lcsb.backward == "all_reached"
    assert lcsb.unreached == "skip_below"
    recorder = _fit(TokenLM(residual_net(num_blocks=8)), lcsb, steps=8)
    assert [len(s) for s in recorder.selections] == [8, 2, 4, 2, 8, 2, 4, 2]  # N, N/4, N/2, N/4: 3 levels
    assert all(s == tuple(range(8 - len(s), 8)) for s in recorder.selections)  # always the top blocks


def test_all_reached_backward_trains_every_block_above_the_selection(residual_net) -> None:
    lcsb = LCSBCallback("cyclic", layers_per_step=1, backward="all_reached", log_every_n_steps=0)
    recorder = _fit(TokenLM(residual_net(num_blocks=4)), lcsb, steps=4)
    assert recorder.selections == [(0, 1, 2, 3), (1, 2, 3), (2, 3), (3,)]
    assert lcsb.selection_counts == [1, 2, 3, 4]


@pytest.mark.parametrize("policy", ["cyclic", "random", "grad_norm"])
def test_resume_continues_the_exact_sequence(residual_net, tmp_path: Path, policy: str) -> None:
    def run(steps: int, ckpt_path: str | None = None, checkpoint_dir: Path | None = None) -> tuple[TokenLM, Recorder]:
        model = TokenLM(residual_net(num_blocks=6, seed=0), lr=0.02)
        lcsb = LCSBCallback(policy, layers_per_step=2, seed=7)
        recorder = Recorder(lcsb)
        callbacks: list[Callback] = [lcsb, recorder]
        if checkpoint_dir is not None:
            callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_last=True, every_n_train_steps=4))
        trainer = quiet_trainer(max_steps=steps, callbacks=callbacks, enable_checkpointing=checkpoint_dir is not None)
        trainer.fit(model, token_batches(num_batches=4), ckpt_path=ckpt_path)
        return model, recorder

    full_model, full = run(12)
    run(4, checkpoint_dir=tmp_path)
    resumed_model, resumed = run(12, ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.selections == full.selections[4:]
    assert resumed_model.losses == full_model.losses[4:]


def test_a_resume_with_other_policy_arguments_is_refused_before_any_step(residual_net, tmp_path: Path) -> None:
    def fit(model: TokenLM, levels: int, steps: int, ckpt_path: str | None = None) -> None:
        lcsb = LCSBCallback(DyadicPolicy(levels=levels), log_every_n_steps=0)
        trainer = quiet_trainer(max_steps=steps, callbacks=[lcsb, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                                enable_checkpointing=True)
        trainer.fit(model, token_batches(num_batches=4), ckpt_path=ckpt_path)

    fit(TokenLM(residual_net(num_blocks=8)), levels=4, steps=2)
    resumed = TokenLM(residual_net(num_blocks=8))
    with pytest.raises(ValueError, match="the checkpoint has levels=4, this policy has levels=3.*build the policy with `levels=4`"):
        fit(resumed, levels=3, steps=4, ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.losses == []


def test_a_checkpoint_of_0_5_with_the_removed_options_state_loads(residual_net) -> None:
    from lcsb_lightning.controller import LCSBController

    controller = LCSBController(residual_net(num_blocks=2), CyclicPolicy(layers_per_step=1))
    controller.begin_step(0)
    state = {**controller.state_dict(), "steps_selected": 1, "last_grads": {0: [torch.ones(2)]}}  # as 0.5 saved it
    twin = LCSBController(residual_net(num_blocks=2), CyclicPolicy(layers_per_step=1))
    twin.load_state_dict(state)
    assert twin.state_dict() == controller.state_dict()
    controller.release()
    twin.release()


def test_tensorboard_gets_scalars_and_selection_image(residual_net, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = TokenLM(residual_net(num_blocks=4))
    lcsb = LCSBCallback("cyclic", layers_per_step=1, log_every_n_steps=4)
    logger = TensorBoardLogger(tmp_path, name="tb")
    _fit(model, lcsb, steps=8, logger=logger, log_every_n_steps=1)
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0}).Reload()
    assert "lcsb/num_selected" in events.Tags()["scalars"]
    assert {f"lcsb/grad_norm/block_{i:02d}" for i in range(4)} <= set(events.Tags()["scalars"])
    images = events.Images("lcsb/selection")
    assert len(images) == 2 and images[0].height == 4 * 4 and images[0].width == 4 * 4


def test_logger_without_images_warns_once(residual_net, tmp_path: Path) -> None:
    model = TokenLM(residual_net(num_blocks=2))
    with pytest.warns(UserWarning, match="CSVLogger cannot log images"):
        _fit(model, LCSBCallback("cyclic", layers_per_step=1, log_every_n_steps=2), steps=4,
             logger=CSVLogger(tmp_path), log_every_n_steps=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(policy="lisa", layers_per_step=1), ValueError, r"Unknown policy 'lisa'; available: cyclic, dyadic, full, grad_norm, random, top_only\.$"),
        # removed in 0.8.0 (a negative result, docs/log/0.7.md)
        (dict(policy="dropbp"), ValueError, r"Unknown policy 'dropbp'; available: cyclic, dyadic, full, grad_norm, random, top_only\.$"),
        (dict(policy="cyclic", layers_per_step=1, backward="approx"), ValueError, r"`backward='approx'` is not supported; allowed: identity, selected_only, all_reached\.$"),
        (dict(backward="truncated"), ValueError, r"`backward='truncated'` is not supported; allowed: identity, selected_only, all_reached\.$"),
        (dict(unreached="skip"), ValueError, r"`unreached='skip'` is not supported; allowed: skip_below, implicit\.$"),
        (dict(policy="cyclic", layers_per_step=0), ValueError, "`layers_per_step` must be an integer >= 1, got 0"),
        (dict(policy="cyclic", fraction=0.0), ValueError, "`fraction` must be in \\(0, 1\\], got 0.0"),
        (dict(policy="cyclic", layers_per_step=2, fraction=0.5), ValueError, "Give only one of `layers_per_step`"),
        (dict(policy="cyclic"), ValueError, "CyclicPolicy needs `layers_per_step=k` or `fraction=f`; got neither"),
        (dict(layers_per_step=4), ValueError, r"`layers_per_step=4` sizes the policies .*; 'dyadic' takes none\.$"),
        (dict(policy=CyclicPolicy(layers_per_step=1), layers_per_step=2), ValueError, "`layers_per_step=2` configures a policy built by name"),
        (dict(policy=CyclicPolicy(layers_per_step=1), switch_every=2), ValueError,
         r"`switch_every=2` configures a policy built by name; .* instance .* carries its own\.$"),
        (dict(policy=CyclicPolicy(layers_per_step=1), seed=3), ValueError,
         r"`seed=3` configures a policy built by name; .* instance .* carries its own\.$"),
        (dict(policy=3), TypeError, "`policy` must be a name or a SelectionPolicy, got int"),
        (dict(policy="cyclic", layers_per_step=1, log_every_n_steps=-1), ValueError, "`log_every_n_steps` must be an integer >= 0"),
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        LCSBCallback(**kwargs)


def test_fit_time_errors(residual_net) -> None:
    with pytest.raises(ValueError, match="`layers_per_step=5` exceeds the model's 4 blocks; allowed: 1..4"):
        _fit(TokenLM(residual_net(num_blocks=4)), LCSBCallback("cyclic", layers_per_step=5), steps=1)
    frozen = residual_net(num_blocks=4)
    frozen.stack.requires_grad_(False)
    with pytest.raises(ValueError, match="No trainable parameter inside any of the 4 blocks"):
        _fit(TokenLM(frozen), LCSBCallback("cyclic", layers_per_step=1), steps=1)
    model = TokenLM(residual_net(num_blocks=4), optimizer_from_requires_grad=False)
    with pytest.raises(ValueError, match="16 trainable block parameters are in no optimizer param group"):
        _fit(model, LCSBCallback("cyclic", layers_per_step=1), steps=1)
    assert all(p.requires_grad for p in model.model.stack.parameters())


@pytest.mark.parametrize(("backward", "exact_blocks"), [("selected_only", True), ("identity", False)])
def test_probe_measures_the_fidelity_of_the_gradient_used(tmp_path: Path, backward: str, exact_blocks: bool) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = TokenLM(tiny_llama_peft(num_layers=4), lr=5e-3)
    lcsb = LCSBCallback("cyclic", layers_per_step=1, backward=backward, probe_every=3, log_every_n_steps=0)
    logger = TensorBoardLogger(tmp_path, name="tb")
    _fit(model, lcsb, steps=8, logger=logger, log_every_n_steps=1)
    assert [r.step for r in lcsb.probe_results] == [0, 3, 6]
    assert [list(r.cosine) for r in lcsb.probe_results] == [[0], [3], [2]]  # the block trained at that step
    top = lcsb.probe_results[1]  # block 3 is the top block: nothing above it, so both paths are exact
    assert top.cosine[3] == pytest.approx(1.0, abs=1e-5) and top.norm_ratio[3] == pytest.approx(1.0, abs=1e-4)
    low = lcsb.probe_results[0].cosine[0]
    if exact_blocks:
        assert low == pytest.approx(1.0, abs=1e-5)
    else:  # the identity path approximates the three blocks above block 0
        assert low < 0.999
    # the probe ran training_step once more at steps 0, 3 and 6, on the same batch: the same loss, bit for bit
    assert len(model.losses) == 8 + 3 and model.losses[0] == model.losses[1] and model.losses[4] == model.losses[5]
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0}).Reload()
    assert "lcsb/probe/cos/block_00" in events.Tags()["scalars"] and "lcsb/probe" in events.Tags()["images"]


class _LoggingLM(TokenLM):
    """Logs its loss through a wrapper set on the instance, as instrumentation does; records what it logged."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.logged: list[str] = []
        own_log = self.log

        def counted_log(name: str, *args: Any, **kwargs: Any) -> None:
            self.logged.append(name)
            own_log(name, *args, **kwargs)

        self.log = counted_log  # type: ignore[method-assign]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss


def test_the_probe_mutes_logging_for_its_rerun_only(residual_net) -> None:
    model = _LoggingLM(residual_net(num_blocks=2))
    wrapper = model.log
    _fit(model, LCSBCallback("cyclic", layers_per_step=1, probe_every=2, log_every_n_steps=0), steps=6)
    assert len(model.losses) == 6 + 3  # training_step ran again at steps 0, 2 and 4
    assert model.logged.count("train/loss") == 6  # the re-runs logged nothing, the steps everything
    assert model.log is wrapper


@pytest.mark.parametrize("own", [True, False], ids=["instance-attribute", "class-method"])
def test_muted_logging_restores_exactly_what_was_there(residual_net, own: bool) -> None:
    from lcsb_lightning.callback import logging_muted

    model = _LoggingLM(residual_net(num_blocks=2)) if own else TokenLM(residual_net(num_blocks=2))
    before = dict(vars(model))
    with pytest.raises(RuntimeError, match="inside"), logging_muted(model):
        assert model.log("x", 1.0) is None and model.log_dict({"x": 1.0}) is None  # no trainer needed: muted
        raise RuntimeError("inside")
    assert {k: v for k, v in vars(model).items() if k in ("log", "log_dict")} == \
        {k: v for k, v in before.items() if k in ("log", "log_dict")}
    assert ("log" in vars(model)) == own and "log_dict" not in vars(model)
