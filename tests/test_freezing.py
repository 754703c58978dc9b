"""Progressive freezing: frozen blocks run without a graph, their stored outputs replay them exactly."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lcsb_lightning import LCSBCallback
from lcsb_lightning.blocks import find_blocks
from lcsb_lightning.freezing import ProgressiveFreezing
from lcsb_lightning.policies import GradNormPolicy
from lcsb_lightning.prefix_cache import FrozenPrefix
from tests.conftest import TokenLM, quiet_trainer, tiny_llama_peft, token_batches

NUM_BLOCKS = 4
FROZEN = 2


def _padded_batch(lengths: list[int], width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of the given real lengths (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for j, length in enumerate(lengths):
        ids[j, :length] = torch.randint(1, 64, (length,), generator=g)
        mask[j, :length] = 1
    return ids, mask


def _loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    labels = ids.masked_fill(mask == 0, -100)
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _freeze_lowest(model: nn.Module, frozen: int) -> list[nn.Module]:
    blocks = find_blocks(model)
    for block in blocks[:frozen]:
        block.requires_grad_(False)
    return blocks


def _linear_calls(blocks: list[nn.Module]) -> list[int]:
    """Per block, a counter of its Linear forwards (filled by hooks)."""
    calls = [0] * len(blocks)
    for index, block in enumerate(blocks):
        for module in block.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    return calls


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layouts", [
    pytest.param([([7, 7], 8), ([7, 7], 10)], id="same-batch-wider"),
    pytest.param([([5, 9], 10), ([9, 5], 10)], id="rows-swapped"),
    pytest.param([([5, 9, 3], 10), ([3, 5, 9], 12)], id="three-rows-reordered-wider"),
    pytest.param([([5, 9], 10), ([9, 5], 9), ([5, 9], 12)], id="narrower-then-wider"),
])
def test_replay_gives_the_loss_and_gradients_of_the_frozen_blocks(layouts: list[tuple[list[int], int]]) -> None:
    """Rows (real lengths) in right-padded batches (widths), the first one stored: the later ones replay in any order
    and at any width (dynamic padding), with the loss and the gradients of the frozen blocks run: bit for bit at the
    width they were stored at, and at another to the rounding by which the frozen blocks themselves differ there."""
    reference, cached = tiny_llama_peft(NUM_BLOCKS), tiny_llama_peft(NUM_BLOCKS)
    _freeze_lowest(reference, FROZEN)
    blocks = _freeze_lowest(cached, FROZEN)
    calls = _linear_calls(blocks)
    prefix = FrozenPrefix(blocks)
    prefix.freeze(FROZEN)
    rows = {length: _padded_batch([length], 12, seed=length) for length in {n for layout, _ in layouts for n in layout}}
    for step, (layout, width) in enumerate(layouts):
        ids = torch.zeros(len(layout), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, length in enumerate(layout):
            ids[j, :length], mask[j, :length] = rows[length][0][0, :length], 1
        before = list(calls)
        prefix.set_batch(ids, mask)
        loss = _loss(cached, ids, mask)
        loss.backward()
        prefix.end_batch()
        expected = _loss(reference, ids, mask)
        expected.backward()
        got, want = _grads(cached), _grads(reference)
        assert got.keys() == want.keys() and got
        tolerance = 0.0 if width == layouts[0][1] else 1e-6
        torch.testing.assert_close(loss, expected, rtol=0, atol=tolerance)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=tolerance, msg=name)
        assert not any("layers.0." in name or "layers.1." in name for name in got)  # no gradient in the frozen blocks
        ran = [after - b for after, b in zip(calls, before)]
        assert (ran[0] > 0) == (step == 0) and (ran[1] > 0) == (step == 0), ran  # a hit skips the frozen forward
        assert ran[2] > 0 and ran[3] > 0
        cached.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert prefix.stats.hits == len(layouts) - 1 and prefix.padding_read is False
    prefix.remove()


def _two_training_forwards(prefix: FrozenPrefix, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The same right-padded batch twice (the second can replay the first's stored outputs); returns it."""
    ids, mask = _padded_batch([6, 6], 6)
    for _ in range(2):
        prefix.set_batch(ids, mask)
        _loss(model, ids, mask)
        prefix.end_batch()
    return ids, mask


def test_evaluation_and_unnamed_batches_run_every_block() -> None:
    model = tiny_llama_peft(NUM_BLOCKS)
    blocks = _freeze_lowest(model, FROZEN)
    calls = _linear_calls(blocks)
    prefix = FrozenPrefix(blocks)
    prefix.freeze(FROZEN)
    ids, mask = _two_training_forwards(prefix, model)
    assert prefix.stats.hits == 1
    before = list(calls)
    _loss(model, ids, mask)  # no batch named: not a training step of the prefix
    assert all(after > b for after, b in zip(calls, before)), (before, calls)
    model.eval()
    prefix.set_batch(ids, mask)
    before = list(calls)
    with torch.no_grad():
        _loss(model, ids, mask)
    assert all(after > b for after, b in zip(calls, before)), (before, calls)
    assert prefix.stats.hits == 1
    prefix.remove()


ROW_BYTES = 12 * (32 + 2) * 4  # a 12-token row: its hidden states (32 floats a token) and its probe (2)


@pytest.mark.parametrize(("max_bytes", "stored", "dropped"), [(0, 0, 0), (ROW_BYTES, 1, 1), (2**20, 2, 0)])
def test_the_store_keeps_to_its_budget(max_bytes: int, stored: int, dropped: int) -> None:
    model = tiny_llama_peft(NUM_BLOCKS)
    prefix = FrozenPrefix(_freeze_lowest(model, FROZEN), max_bytes=max_bytes)
    prefix.freeze(FROZEN)
    ids, mask = _padded_batch([12, 12], 12)
    prefix.set_batch(ids, mask)
    _loss(model, ids, mask)
    prefix.end_batch()
    assert (prefix.stats.stored_examples, prefix.stats.dropped_examples) == (stored, dropped)
    assert prefix.stats.stored_bytes <= max_bytes
    prefix.remove()


def test_a_growing_freeze_starts_from_the_outputs_stored_before() -> None:
    reference, model = tiny_llama_peft(NUM_BLOCKS), tiny_llama_peft(NUM_BLOCKS)
    _freeze_lowest(reference, 3)
    blocks = _freeze_lowest(model, 3)
    calls = _linear_calls(blocks)
    prefix = FrozenPrefix(blocks)
    ids, mask = _padded_batch([8, 5], 8)

    def step() -> list[int]:
        before = list(calls)
        prefix.set_batch(ids, mask)
        loss = _loss(model, ids, mask)
        prefix.end_batch()
        torch.testing.assert_close(loss, _loss(reference, ids, mask), rtol=0, atol=1e-6)
        return [int(after > b) for after, b in zip(calls, before)]

    prefix.freeze(1)
    assert step() == [1, 1, 1, 1]  # block 0 runs (no graph) and its outputs are stored
    prefix.freeze(3)
    assert step() == [0, 1, 1, 1]  # seeded: block 0's stored outputs, blocks 1 and 2 run once
    assert prefix.stats.seeded == 1 and prefix.stats.stored_examples == 2
    assert step() == [0, 0, 0, 1]  # a hit
    assert prefix.store.previous == {}  # every seed was used and dropped
    prefix.freeze(2)  # a freeze that shrinks empties the store
    assert prefix.stats.stored_examples == 0 and step() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="num_blocks=5"):
        prefix.freeze(5)
    prefix.remove()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"schedule": {}}, "schedule="),
    ({"schedule": {-1: 2}}, "epoch"),
    ({"schedule": {"x": 2}}, "epoch"),
    ({"schedule": [[1, 2], [1, 3]]}, "epoch 1 twice"),
    ({"schedule": [1, 2]}, "must be a mapping"),
    ({"schedule": []}, "is empty"),
    ({"schedule": {1: 1.5}}, r"schedule\[1\]=1.5"),
    ({"schedule": {1: -2}}, r"schedule\[1\]=-2"),
    ({"schedule": {1: "half"}}, r"schedule\[1\]='half'"),
    ({"schedule": {1: 2}, "max_cache_mb": -1}, "max_cache_mb=-1"),
])
def test_bad_arguments_fail_fast(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ProgressiveFreezing(**kwargs)


@pytest.mark.parametrize(("schedule", "match"), [
    ({1: 4}, "freezes 4 of the model's 4 blocks"),
    ({1: 3, 2: 1}, "unfreezes blocks"),
])
def test_schedules_the_model_cannot_take_fail_at_fit_start(schedule: dict[int, int], match: str) -> None:
    module = TokenLM(tiny_llama_peft(NUM_BLOCKS))
    trainer = quiet_trainer(max_epochs=1, callbacks=[ProgressiveFreezing(schedule)])
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, token_batches(num_batches=2, vocab=64))
    assert all(p.requires_grad for n, p in module.named_parameters() if "lora_" in n)


def test_a_trainable_embedding_tied_to_the_head_cannot_be_cached() -> None:
    model = tiny_llama_peft(NUM_BLOCKS)
    base = model.get_base_model()
    base.lm_head.weight = base.model.embed_tokens.weight
    base.model.embed_tokens.weight.requires_grad_(True)
    trainer = quiet_trainer(max_epochs=1, callbacks=[ProgressiveFreezing({1: 1})])
    with pytest.raises(ValueError, match="tied to the LM head"):
        trainer.fit(TokenLM(model), token_batches(num_batches=2, vocab=64))


def test_several_processes_are_refused() -> None:
    class Trainer:
        world_size = 2

    with pytest.raises(ValueError, match="one process; this Trainer has 2"):
        ProgressiveFreezing({1: 1}).setup(Trainer(), None, "fit")  # type: ignore[arg-type]


def _shuffled_batches(num_batches: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (num_batches * 2, 10), generator=g)
    return DataLoader(TensorDataset(tokens), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))


def _fit(callbacks: list[Any], epochs: int = 3) -> tuple[TokenLM, dict[str, torch.Tensor], dict[str, float]]:
    torch.manual_seed(0)
    module = TokenLM(tiny_llama_peft(NUM_BLOCKS), lr=5e-3)
    snapshots: dict[str, torch.Tensor] = {}

    class Snapshot(Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            for name, p in pl_module.named_parameters():
                if "lora_" in name:
                    snapshots[f"{trainer.current_epoch}:{name}"] = p.detach().clone()

    trainer = quiet_trainer(max_epochs=epochs, callbacks=[*callbacks, Snapshot()])
    trainer.fit(module, _shuffled_batches())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return module, snapshots, metrics


@pytest.mark.parametrize("lcsb", [None, "full", "dyadic"])
def test_a_fit_with_the_cache_trains_exactly_as_without_it(lcsb: str | None) -> None:
    def lcsb_callbacks() -> list[Any]:
        return [LCSBCallback(lcsb, log_every_n_steps=0)] if lcsb else []

    cached, snaps, metrics = _fit([*lcsb_callbacks(), ProgressiveFreezing({1: FROZEN})])
    plain, _, plain_metrics = _fit([*lcsb_callbacks(), ProgressiveFreezing({1: FROZEN}, cache=False)])
    assert metrics["freeze/cache_hit"] == 1.0 and plain_metrics["freeze/cache_hit"] == 0.0  # the last epoch
    assert metrics["freeze/frozen_blocks"] == FROZEN
    for (name, p), (_, q) in zip(cached.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
        assert p.requires_grad == ("lora_" in name)  # handed back when fit ends
    lora = {key.split(":", 1)[1] for key in snaps}
    for name in lora:
        frozen = any(f"layers.{i}." in name for i in range(FROZEN))
        # frozen from epoch 1 on: no update at all (not even LCSB's implicit momentum); the others keep training
        assert torch.equal(snaps[f"0:{name}"], snaps[f"2:{name}"]) == frozen, name


@pytest.mark.parametrize("backward", ["identity", "selected_only"])
def test_a_selection_of_frozen_blocks_moves_onto_the_blocks_that_train(backward: str) -> None:
    """The cyclic policy over 4 blocks would select a frozen block in 2 steps of 4 (blocks 0 and 1, frozen from epoch
    1): the identity path would then have no graph at all (the backward failed), ``selected_only`` a backward that
    trains nothing. The policy selects over the blocks that train: 2, 3, 2, 3 in each epoch."""
    lcsb = LCSBCallback("cyclic", layers_per_step=1, backward=backward, log_every_n_steps=0)
    _, snaps, metrics = _fit([lcsb, ProgressiveFreezing({1: FROZEN})])
    assert metrics["freeze/frozen_blocks"] == FROZEN
    assert lcsb.selection_counts == [1, 1, 5, 5]  # epoch 0: one step each; epochs 1 and 2: four steps each
    for key in [k for k in snaps if k.startswith("1:")]:
        name = key.split(":", 1)[1]
        frozen = any(f"layers.{i}." in name for i in range(FROZEN))
        assert torch.equal(snaps[f"1:{name}"], snaps[f"2:{name}"]) == frozen, name


def test_state_round_trips() -> None:
    callback = ProgressiveFreezing({1: 2})
    callback.frozen = 2
    other = ProgressiveFreezing({1: 2})
    other.load_state_dict(callback.state_dict())
    assert other.frozen == 2 and other.state_key == callback.state_key
    assert [callback.blocks_at(epoch, 30) for epoch in range(3)] == [0, 2, 2]
    assert ProgressiveFreezing({0: 0.5, 2: 0.75}).blocks_at(2, 30) == 22
    assert ProgressiveFreezing([[2, 0.75], [0, 0.5]]).schedule == ProgressiveFreezing({"0": 0.5, 2: 0.75}).schedule


def test_a_guard_rollback_to_before_the_freeze_leaves_the_frozen_blocks_as_frozen() -> None:
    """The guard's snapshot predates the freeze; restoring it must not move the frozen blocks (their stored
    outputs would no longer be theirs)."""
    from lcsb_lightning.guard import DivergenceGuard
    from tests.conftest import FaultyLM

    module = FaultyLM("nan", at_step=5)
    guard = DivergenceGuard(action="rollback", window=10, warmup=1, snapshot_every=100)  # one snapshot: step 0
    frozen_at_freeze: dict[str, torch.Tensor] = {}

    class Record(Callback):  # after the freeze of epoch 1
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch == 1:
                frozen_at_freeze.update({n: p.detach().clone() for n, p in pl_module.named_parameters()
                                         if "lora_" in n and "layers.0." in n})

    trainer = quiet_trainer(max_epochs=4, callbacks=[ProgressiveFreezing({1: 1}), Record(), guard])
    with pytest.warns(UserWarning, match="DivergenceGuard: step 5"):
        trainer.fit(module, token_batches(num_batches=2, vocab=64))
    assert guard.events and guard.events[0]["restored"] == 0
    after = dict(module.named_parameters())
    assert frozen_at_freeze and all(torch.equal(after[n], v) for n, v in frozen_at_freeze.items())


def test_frozen_blocks_are_not_checkpointed_by_quantized_mebp() -> None:
    """With QuantizedMeBP's per-block checkpoints a trained block runs twice a step (forward, recompute in
    backward); a frozen one runs once while its output is stored and not at all once it is replayed."""
    from lcsb_lightning.mebp import apply_mebp

    model = apply_mebp(tiny_llama_peft(NUM_BLOCKS), fmt="int4", group_size=32)
    blocks = _freeze_lowest(model, FROZEN)
    calls = [0] * len(blocks)
    for index, block in enumerate(blocks):
        block.self_attn.q_proj.register_forward_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    prefix = FrozenPrefix(blocks)
    prefix.freeze(FROZEN)
    ids, mask = _padded_batch([9, 6], 9)
    per_step = []
    for _ in range(2):
        before = list(calls)
        prefix.set_batch(ids, mask)
        _loss(model, ids, mask).backward()
        prefix.end_batch()
        per_step.append([after - b for after, b in zip(calls, before)])
    assert per_step == [[1, 1, 2, 2], [0, 0, 2, 2]]
    prefix.remove()


# ------------------------------------------------------------------ what the frozen blocks would really compute
def _llama(tied: bool = False, lora_dropout: float = 0.0) -> nn.Module:
    """The tiny peft Llama of ``tiny_llama_peft``, with its embedding tied to the head (and training), or with
    peft's ``lora_dropout``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_BLOCKS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules="all-linear",
                      lora_dropout=lora_dropout)
    model = get_peft_model(LlamaForCausalLM(config), lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    if tied:
        model.get_input_embeddings().weight.requires_grad_(True)
    return model


class PaddedLM(LightningModule):
    """A causal LM on right-padded ``{"input_ids", "attention_mask"}`` batches; ``step(module, ids, mask)`` is the
    training step's loss (what a ``training_step`` may do besides one plain forward)."""

    def __init__(self, model: nn.Module, step: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model, self.step = model, step
        self.losses: list[float] = []

    def loss(self, ids: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), **kwargs).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.step(self, batch["input_ids"], batch["attention_mask"])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=5e-3)


def _padded_loader() -> DataLoader:
    """8 examples of 5 to 12 tokens, shuffled anew each epoch, padded to each batch's longest (dynamic padding)."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 64, (int(n),), generator=g) for n in torch.randint(5, 13, (8,), generator=g)]

    def collate(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = torch.zeros(len(batch), max(len(r) for r in batch), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, row in enumerate(batch):
            ids[j, : len(row)], mask[j, : len(row)] = row, 1
        return {"input_ids": ids, "attention_mask": mask}

    return DataLoader(rows, batch_size=2, shuffle=True, collate_fn=collate, generator=torch.Generator().manual_seed(1))


def _plain(m: PaddedLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return m.loss(ids, mask)


def _pad_in_the_loss(m: PaddedLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return m.model(input_ids=ids, attention_mask=mask, labels=ids).loss  # pad = EOS: padded positions are labels


def _second_forward(m: PaddedLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    shifted = ids.clone()
    shifted[:, 0] = (shifted[:, 0] + 1) % 64
    return m.loss(ids, mask) + m.loss(shifted, mask)


def _masked_tokens(m: PaddedLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ids = ids.clone()
    ids[:, 1] = m.current_epoch + 1  # changes after the batch named its rows: another input reaches block 0
    return m.loss(ids, mask)


def _shifted_positions(m: PaddedLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).unsqueeze(0) + m.current_epoch
    return m.loss(ids, mask, position_ids=positions)


def _truncated(m: PaddedLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    end = ids.shape[1] - 3 + m.current_epoch  # rows cut shorter than the batch's mask says, less so each epoch
    return m.loss(ids[:, :end], mask[:, :end])


def _dyadic() -> list[Callback]:
    return [LCSBCallback("dyadic", log_every_n_steps=0)]


def _identity() -> list[Callback]:  # block 2, the lowest unfrozen one, cut: it passes the gradient down unchanged
    return [LCSBCallback("top_only", layers_per_step=1, backward="identity", log_every_n_steps=0)]


@pytest.mark.parametrize(("step", "lora_dropout", "lcsb", "hit"), [
    pytest.param(_plain, 0.0, list, 1.0, id="dynamic-padding"),
    pytest.param(_plain, 0.0, _dyadic, 1.0, id="dynamic-padding-lcsb-dyadic"),
    pytest.param(_plain, 0.0, _identity, 1.0, id="dynamic-padding-lcsb-identity"),
    # the padded positions are read: a row replays only into batches no wider than the one it was stored from
    pytest.param(_pad_in_the_loss, 0.0, list, 0.5, id="padded-positions-in-the-loss"),
    pytest.param(_second_forward, 0.0, list, 1.0, id="second-forward"),  # the first forward replays, the second not
    pytest.param(_masked_tokens, 0.0, list, 0.0, id="tokens-changed-in-training-step"),
    pytest.param(_shifted_positions, 0.0, list, 0.0, id="position-ids"),
    pytest.param(_truncated, 0.0, list, 0.0, id="rows-cut-shorter"),
    pytest.param(_plain, 0.1, list, 0.0, id="lora-dropout"),
])
def test_the_store_replays_only_what_the_frozen_blocks_would_compute(
        step: Callable[..., torch.Tensor], lora_dropout: float, lcsb: Callable[[], list[Callback]], hit: float) -> None:
    """Against ``cache=False`` (the frozen blocks run at every step): the same losses and weights, whatever the
    training step does to the batch (a loss on the padded positions included), and the last epoch's hit rate."""
    def fit(cache: bool) -> tuple[PaddedLM, dict[str, float]]:
        torch.manual_seed(0)
        module = PaddedLM(_llama(lora_dropout=lora_dropout), step)
        trainer = quiet_trainer(max_epochs=3, callbacks=[*lcsb(), ProgressiveFreezing({1: FROZEN}, cache=cache)])
        trainer.fit(module, _padded_loader())
        return module, {k: float(v) for k, v in trainer.callback_metrics.items()}

    if lora_dropout:
        with pytest.warns(UserWarning, match="dropout is active in the frozen blocks"):
            cached, metrics = fit(cache=True)
    else:
        cached, metrics = fit(cache=True)
    plain, _ = fit(cache=False)
    assert metrics["freeze/cache_hit"] == hit
    torch.testing.assert_close(cached.losses, plain.losses, rtol=0, atol=1e-6)
    for (name, p), (_, q) in zip(cached.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_a_tied_embedding_trains_on_in_a_frozen_epoch() -> None:
    """``cache=False`` keeps an input embedding tied to the LM head training: it is the head too."""
    module = PaddedLM(_llama(tied=True), _plain)
    embedding = module.model.get_input_embeddings().weight
    assert embedding is module.model.get_output_embeddings().weight
    by_epoch: list[torch.Tensor] = []

    class Snapshot(Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            by_epoch.append(embedding.detach().clone())

    trainer = quiet_trainer(max_epochs=3, callbacks=[ProgressiveFreezing({1: 1}, cache=False), Snapshot()])
    trainer.fit(module, _padded_loader())
    assert not torch.equal(by_epoch[1], by_epoch[2])  # epoch 2: a frozen epoch after the first frozen batch
    assert embedding.requires_grad


def test_a_second_fit_starts_unfrozen() -> None:
    callback = ProgressiveFreezing({1: 1})
    module = PaddedLM(_llama(), _plain)
    quiet_trainer(max_epochs=2, callbacks=[callback]).fit(module, _padded_loader())
    assert callback.frozen == 1
    lora0 = {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n and "layers.0." in n}
    trainer = quiet_trainer(max_epochs=1, callbacks=[callback])
    trainer.fit(module, _padded_loader())
    assert trainer.callback_metrics.get("freeze/frozen_blocks") is None and callback.frozen == 0
    after = dict(module.named_parameters())
    assert all(not torch.equal(after[n], v) for n, v in lora0.items())  # block 0 trained in epoch 0


def test_a_full_store_makes_room_for_the_outputs_of_a_grown_freeze() -> None:
    """A store with room for exactly the data set: after each growth the new outputs replace the old ones (the
    old one of an example is released before the new one is budgeted), so the next pass hits again."""
    model = tiny_llama_peft(NUM_BLOCKS)
    blocks = _freeze_lowest(model, 3)
    batches = [_padded_batch([9, 6], 9, seed=0), _padded_batch([7, 8], 8, seed=1)]

    def epoch(prefix: FrozenPrefix) -> None:
        for ids, mask in batches:
            prefix.set_batch(ids, mask)
            _loss(model, ids, mask)
            prefix.end_batch()

    sizing = FrozenPrefix(blocks)
    sizing.freeze(1)
    epoch(sizing)
    data_set_bytes = sizing.stats.stored_bytes
    sizing.remove()
    prefix = FrozenPrefix(blocks, max_bytes=data_set_bytes)
    for frozen in (1, 2, 3):  # grows twice
        prefix.freeze(frozen)
        epoch(prefix)  # stores (seeded from the previous outputs after a growth)
        hits = prefix.stats.hits
        epoch(prefix)
        assert prefix.stats.hits == hits + len(batches), frozen
        assert prefix.stats.stored_bytes == data_set_bytes and prefix.stats.dropped_examples == 0
    prefix.remove()


def _attention_dropout() -> nn.Module:
    model = tiny_llama_peft(NUM_BLOCKS)
    find_blocks(model)[1].self_attn.attention_dropout = 0.1
    return model


@pytest.mark.parametrize("make", [
    pytest.param(lambda: _llama(lora_dropout=0.1), id="lora-dropout"),
    pytest.param(_attention_dropout, id="attention-dropout"),
])
def test_a_freeze_over_an_active_dropout_stores_nothing(make: Callable[[], nn.Module]) -> None:
    model = make()
    blocks = _freeze_lowest(model, FROZEN)
    prefix = FrozenPrefix(blocks)
    with pytest.warns(UserWarning, match="dropout is active in the frozen blocks \\(block [01]'s"):
        prefix.freeze(FROZEN)
    _two_training_forwards(prefix, model)
    assert prefix.stats.stored_examples == 0 and prefix.stats.hits == 0
    prefix.remove()


class _LowestBlockLoudest(GradNormPolicy):
    """GradNorm under adversarial norms: the lowest block it selects over measures 100, the others 0.01, so they
    train only when they are overdue."""

    def observe(self, grad_norms: dict[int, float]) -> None:
        super().observe({i: 100.0 if i == 0 else 0.01 for i in grad_norms})


class _Trained(Callback):
    """Per optimizer step: the blocks that train (selected and not frozen) and how many blocks are frozen."""

    def __init__(self, lcsb: LCSBCallback) -> None:
        self.lcsb = lcsb
        self.steps: list[tuple[set[int], int]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        params = self.lcsb.controller.block_params.params_per_block
        frozen = next(i for i, block in enumerate(params) if any(p.requires_grad for p in block))
        self.steps.append(({i for i in self.lcsb.selection if i >= frozen}, frozen))


@pytest.mark.parametrize("backward", ["selected_only", "identity", "all_reached"])
def test_grad_norms_staleness_bound_holds_for_every_block_that_trains(residual_net, backward: str) -> None:
    """100 steps, 2 of 6 blocks frozen from epoch 2 and 4 from epoch 5, adversarial norms: a gap between two
    trainings of a block is at most the staleness bound of GradNorm over the blocks that train at its start (the
    bound only shrinks as the freeze grows). Before, the policy chose over all 6 blocks and its choices of frozen
    blocks were moved onto the others: the top block went 12 steps untrained where the bound over the 4 blocks that
    trained is 11, and the policy's bound was the one over 6 blocks (17)."""
    blocks, steps = 6, 100
    lcsb = LCSBCallback(_LowestBlockLoudest(layers_per_step=1), backward=backward, log_every_n_steps=0)
    trained = _Trained(lcsb)
    trainer = quiet_trainer(max_steps=steps, callbacks=[lcsb, ProgressiveFreezing({2: 2, 5: 4}), trained])
    trainer.fit(TokenLM(residual_net(num_blocks=blocks)), token_batches(num_batches=10))

    def bound(frozen: int) -> int:
        policy = GradNormPolicy(layers_per_step=1)
        policy.setup(blocks - frozen)
        return policy.staleness_bound

    assert len(trained.steps) == steps and trained.steps[-1][1] == 4
    bounds = [bound(frozen) for _, frozen in trained.steps] + [bound(4)]  # [t]: over the blocks that train at step t
    for block in range(4, blocks):  # the blocks that train to the end
        times = [-1] + [t for t, (chosen, _) in enumerate(trained.steps) if block in chosen] + [steps]
        for start, end in zip(times, times[1:]):
            assert end - start <= bounds[start + 1], (block, start, end)
    assert lcsb.policy.staleness_bound == bound(4)


@pytest.mark.parametrize("freezing_first", [False, True], ids=["lcsb-first", "freezing-first"])
def test_a_run_resumed_in_a_frozen_epoch_selects_as_the_uninterrupted_one(residual_net, tmp_path: Any,
                                                                          freezing_first: bool) -> None:
    """Resumed mid-epoch from step 6 (2 of 4 blocks frozen from epoch 1), in either order of the callbacks: a
    freeze restored before LCSB maps the model's trainable parameters must not hide the frozen blocks from it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(steps: int, **kwargs: Any) -> list[tuple[int, ...]]:
        lcsb = LCSBCallback("cyclic", layers_per_step=1, backward="identity", log_every_n_steps=0)
        selections: list[tuple[int, ...]] = []

        class Record(Callback):
            def on_train_batch_end(self, *args: Any) -> None:
                selections.append(lcsb.selection)

        pair = [ProgressiveFreezing({1: FROZEN}), lcsb]
        callbacks = [*(pair[::-1] if not freezing_first else pair), Record(),
                     ModelCheckpoint(dirpath=tmp_path, filename="step6", every_n_train_steps=6, save_top_k=-1)]
        trainer = quiet_trainer(max_steps=steps, callbacks=callbacks, enable_checkpointing=True)
        trainer.fit(TokenLM(residual_net(num_blocks=NUM_BLOCKS)), token_batches(num_batches=4), **kwargs)
        return selections

    expected = fit(10)
    resumed = fit(10, ckpt_path=str(tmp_path / "step6.ckpt"))
    assert resumed == expected[6:]
