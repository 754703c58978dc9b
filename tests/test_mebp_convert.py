"""apply_mebp: what is converted, peft before/after, checkpointing, composition with LCSB, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _mebp_utils import add_lora, lora_grads, tiny_llama, tokens
from lcsb_lightning.blocks import find_blocks
from lcsb_lightning.mebp import apply_mebp, mebp_state
from lcsb_lightning.mebp._internal.formats import get_format
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear
from lcsb_lightning.selective import SelectiveBackprop


def _compressed_per_block(model: nn.Module) -> list[list[CompressedLinear]]:
    return [[m for m in block.modules() if isinstance(m, CompressedLinear)] for block in find_blocks(model)]


@pytest.mark.parametrize("tie", [True, False])
def test_converts_block_linears_and_embeddings(tie: bool) -> None:
    model = apply_mebp(tiny_llama(tie=tie), fmt="int4", group_size=32)
    assert all(len(layers) == 7 for layers in _compressed_per_block(model))
    assert isinstance(model.model.embed_tokens, CompressedEmbedding)
    assert isinstance(model.lm_head, CompressedLinear)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tie
    assert not any(isinstance(m, nn.Linear) and type(m) is nn.Linear for m in model.modules())


def test_compress_embeddings_false_and_ignore_modules_keep_float_layers() -> None:
    model = apply_mebp(tiny_llama(), fmt="int4", compress_embeddings=False, ignore_modules=("down_proj",))
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert all(type(block.mlp.down_proj) is nn.Linear for block in find_blocks(model))
    assert all(isinstance(block.mlp.up_proj, CompressedLinear) for block in find_blocks(model))


@pytest.mark.parametrize("fmt", ["int4", "nf4", "fp4"])
def test_logits_equal_the_round_tripped_float_model(fmt: str) -> None:
    model = tiny_llama()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for module in reference.modules():
            if type(module) in (nn.Linear, nn.Embedding):
                module.weight.copy_(get_format(fmt).dequantize(get_format(fmt).quantize(module.weight, 32), 32, torch.float32))
        ids = tokens()
        expected = reference(ids).logits
        logits = apply_mebp(model, fmt=fmt, group_size=32)(ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int4", "nf4"])
def test_conversion_before_or_after_peft_gives_the_same_model(fmt: str) -> None:
    base = tiny_llama()
    after = apply_mebp(add_lora(copy.deepcopy(base)), fmt=fmt)
    before = add_lora(apply_mebp(copy.deepcopy(base), fmt=fmt))
    buffers_after, buffers_before = dict(after.named_buffers()), dict(before.named_buffers())
    assert buffers_after.keys() == buffers_before.keys()
    assert all(torch.equal(buffers_after[k], buffers_before[k]) for k in buffers_after)
    state_after, state_before = after.state_dict(), before.state_dict()
    assert state_after.keys() == state_before.keys()
    assert all(torch.equal(state_after[k], state_before[k]) for k in state_after)
    q_proj = after.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, CompressedLinear)
    assert q_proj.lora_A["default"].weight.dtype == torch.float32 and q_proj.lora_A["default"].weight.requires_grad
    ids = tokens()
    torch.testing.assert_close(after(ids, labels=ids).loss, before(ids, labels=ids).loss)


@pytest.mark.parametrize("fmt", ["int4", "nf4"])
def test_checkpointed_gradients_equal_non_checkpointed(fmt: str) -> None:
    base = add_lora(tiny_llama())
    plain = apply_mebp(copy.deepcopy(base), fmt=fmt, checkpoint=False)
    ckpt = apply_mebp(copy.deepcopy(base), fmt=fmt, checkpoint=True)
    ids = tokens()
    for model in (plain, ckpt):
        model.train()
        model(ids, labels=ids).loss.backward()
    grads_plain, grads_ckpt = lora_grads(plain), lora_grads(ckpt)
    assert grads_plain.keys() == grads_ckpt.keys() and len(grads_plain) == 4 * 7 * 2
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("checkpoint", [True, False])
@pytest.mark.parametrize("lcsb_outside", [True, False])
def test_lcsb_skipped_block_is_not_decompressed_in_backward(checkpoint: bool, lcsb_outside: bool) -> None:
    model = add_lora(tiny_llama())
    if lcsb_outside:  # QuantizedMeBP's wrapper inside LCSB's
        apply_mebp(model, fmt="int4", checkpoint=checkpoint)
        selective = SelectiveBackprop(find_blocks(model))
    else:  # LCSB's wrapper inside QuantizedMeBP's
        selective = SelectiveBackprop(find_blocks(model))
        apply_mebp(model, fmt="int4", checkpoint=checkpoint)
    model.enable_input_require_grads()  # so that block 1's input needs a gradient even with block 0 skipped
    selective.set_selection([1, 3])
    per_block = _compressed_per_block(model)
    model.train()
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    for index, layers in enumerate(per_block):
        backward = [layer.decompress_count["backward"] for layer in layers]
        forward = [layer.decompress_count["forward"] for layer in layers]
        assert forward == [1] * 7
        assert backward == ([1] * 7 if index in (1, 3) else [0] * 7), (index, backward)
    grads = lora_grads(model)
    assert grads and all(".layers.1." in n or ".layers.3." in n for n in grads)
    selective.remove()


def test_evaluation_under_no_grad_neither_checkpoints_nor_decompresses_in_backward() -> None:
    model = apply_mebp(tiny_llama(), fmt="int4")
    with torch.no_grad():
        model(tokens())
    counts = [layer.decompress_count for layers in _compressed_per_block(model) for layer in layers]
    assert all(c == {"forward": 1, "backward": 0} for c in counts)


def test_state_records_what_was_installed() -> None:
    model = apply_mebp(tiny_llama(num_layers=2), fmt="int4", offload="mmap")
    state = mebp_state(model)
    assert state is not None and state.config.fmt == "int4" and len(state.blocks) == 2
    assert len(state.compressed_modules) == 2 * 7 + 2
    state.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fmt": "int3"}, ValueError, r"`fmt='int3'` is not supported; choose one of 'auto', 'int4', 'int4_asym', 'nf4', 'fp4'"),
        ({"fmt": "int4", "group_size": 48}, ValueError,
         r"`group_size=48` does not divide the 64 input features of `model.layers.0.self_attn.q_proj`"),
        ({"fmt": "int4", "offload": "disk"}, ValueError, r"`offload='disk'` is not supported; choose one of 'none', 'mmap'"),
        ({"fmt": "int4", "checkpoint": "yes"}, TypeError, r"`checkpoint` must be a bool, got 'yes'"),
        ({"fmt": "int4", "ignore_modules": "lm_head"}, TypeError, r"`ignore_modules` must be a collection of module names"),
        ({"fmt": "int4", "ignore_modules": ("layers",), "compress_embeddings": False}, TypeError,
         r"apply_mebp found no `nn.Linear` to compress in the 4 blocks of LlamaForCausalLM"),
    ],
)
def test_errors_before_any_work(kwargs: dict, error: type, match: str) -> None:
    model = tiny_llama()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(error, match=match):
        apply_mebp(model, **kwargs)
    assert not any(isinstance(m, (CompressedLinear, CompressedEmbedding)) for m in model.modules())
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_nothing_to_convert_when_already_converted() -> None:
    model = apply_mebp(tiny_llama(num_layers=2), fmt="int4")
    with pytest.raises(RuntimeError, match="apply_mebp was already applied"):
        apply_mebp(model, fmt="int4")
