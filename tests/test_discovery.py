"""Automatic block discovery on every Hugging Face architecture and on encoder-decoders (T5, BART,
``nn.Transformer``): the blocks each model declares, one list in execution order, and exact gradients
for the selected blocks when the selection holds only the decoder's top."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import transformers as tf
from lightning.pytorch import LightningModule
from lightning.pytorch.demos import Transformer
from torch import nn

from lcsb_lightning.blocks import find_blocks, map_trainable_params, unwrap_model
from lcsb_lightning.selective import SelectiveBackprop

VOCAB = 64


def _llama() -> nn.Module:
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _qwen2() -> nn.Module:
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _gpt2() -> nn.Module:
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=3, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _t5() -> nn.Module:
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))


def _bart() -> nn.Module:
    return tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        forced_eos_token_id=None))


def _demo() -> nn.Module:
    return Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)


# factory, the blocks in execution order (of the unwrapped model), what peft adapts
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], list[nn.Module]], object]] = {
    "llama": (_llama, lambda m: list(m.model.layers), "all-linear"),
    "qwen2": (_qwen2, lambda m: list(m.model.layers), "all-linear"),
    "gpt2": (_gpt2, lambda m: list(m.transformer.h), "all-linear"),
    "t5": (_t5, lambda m: [*m.encoder.block, *m.decoder.block], "all-linear"),
    "bart": (_bart, lambda m: [*m.model.encoder.layers, *m.model.decoder.layers], "all-linear"),
    "nn_transformer": (
        _demo, lambda m: [*m.transformer.encoder.layers, *m.transformer.decoder.layers], ["linear1", "linear2"]
    ),
}
ENCODER_DECODERS = ("t5", "bart", "nn_transformer")


class Holder(LightningModule):
    """A LightningModule holding the (peft) model as ``self.model``, as users write it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _peft(name: str, seed: int = 0) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    make, _, targets = MODELS[name]
    torch.manual_seed(seed)
    model = get_peft_model(make(), LoraConfig(r=2, target_modules=targets, init_lora_weights="gaussian"))
    for param_name, param in model.named_parameters():  # non-zero B: every LoRA parameter gets a gradient
        if "lora_B" in param_name:
            nn.init.normal_(param, std=0.02)
    return model


@pytest.mark.parametrize("wrap", ["plain", "peft", "lightning"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_finds_every_stack_in_execution_order(name: str, wrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    infos: list[str] = []
    monkeypatch.setattr("lcsb_lightning.blocks.rank_zero_info", infos.append)
    model = MODELS[name][0]() if wrap == "plain" else _peft(name)
    expected = MODELS[name][1](unwrap_model(model))
    found = find_blocks(Holder(model) if wrap == "lightning" else model)
    assert [id(b) for b in found] == [id(b) for b in expected]
    if name in ENCODER_DECODERS:
        (info,) = infos
        assert "one list of blocks from 2 stacks, in execution order: " in info
        assert info.index("encoder") < info.index("decoder")
    else:
        assert infos == []  # one stack, nothing to say


def test_no_block_parameter_of_an_encoder_decoder_is_left_outside() -> None:
    """The reported failure: on Lightning's demo Transformer only the decoder layers were found, and
    the encoder's trainable parameters lay outside the blocks (trained at every step)."""
    mapped = map_trainable_params(Holder(_peft("nn_transformer")))
    assert mapped.num_blocks == 4 and mapped.outside == []
    assert all(len(params) > 0 for params in mapped.params_per_block)


def test_blocks_outside_the_declared_stacks_are_named() -> None:
    """A sub-model's stack that the architecture does not declare (a vision tower's layers) stays
    outside the list, and the info message says so."""

    class Tower(tf.LlamaForCausalLM):
        _no_split_modules = ["LlamaDecoderLayer"]

    model = Tower(_llama().config)
    model.vision = nn.ModuleList(tf.models.llama.modeling_llama.LlamaMLP(model.config) for _ in range(2))
    model._no_split_modules = {"LlamaDecoderLayer", "LlamaMLP"}  # what post_init gathers from sub-models
    infos: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("lcsb_lightning.blocks.rank_zero_info", infos.append)
        assert find_blocks(model) == list(model.model.layers)
    assert infos == ["LCSB: blocks model.layers (3 x LlamaDecoderLayer); left outside the blocks, never selected: "
                     "vision (2 x LlamaMLP)."]


def _loss(name: str, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if name == "nn_transformer":
        out = model(ids[:, :-1], ids[:, 1:])
        return nn.functional.nll_loss(out, ids[:, 1:].reshape(-1))
    return model(input_ids=ids, labels=ids).loss


def _grads(blocks: list[list[nn.Parameter]]) -> list[list[torch.Tensor]]:
    return [[p.grad.clone() for p in params] for params in blocks]


@pytest.mark.parametrize("name", ENCODER_DECODERS)
def test_exact_selection_of_top_blocks_gives_full_backprop_gradients(name: str) -> None:
    """Blocks below the lowest selected one are cut by index: with the encoder first, a selection of
    the decoder's top cuts the encoder and the lower decoder blocks, and its gradients stay exact; a
    selection reaching into the encoder's top runs the backward through the decoder's cross-attention."""
    model = _peft(name)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    mapped = map_trainable_params(model)
    params = mapped.params_per_block
    num_encoder = len(MODELS[name][1](unwrap_model(model))) - (3 if name != "nn_transformer" else 2)
    last = mapped.num_blocks - 1
    _loss(name, model, ids).backward()
    full = _grads(params)
    selections = [(last,), (last - 1, last), (num_encoder + 1,), (num_encoder - 1,), (num_encoder - 1, last)]
    for selection in selections:
        model.zero_grad(set_to_none=True)
        selective = SelectiveBackprop(mapped.blocks, params, "selected_only")
        selective.set_selection(selection)
        _loss(name, model, ids).backward()
        selective.remove()
        got = _grads(params)
        for block in range(mapped.num_blocks):
            if block >= min(selection):  # selected, or passing the gradient down to a selected block
                for g, want in zip(got[block], full[block]):
                    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7, msg=f"{selection}: block {block}")
            else:
                assert all(not g.any() for g in got[block]), f"{selection}: block {block} below the selection"
