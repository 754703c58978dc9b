"""Which modules apply_mebp and load_compressed compress: found by isinstance, never a trainable,
an already quantized or a LoRA layer; a scaled embedding keeps its scale."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lcsb_lightning.mebp import CompressedEmbedding, CompressedLinear, apply_mebp, load_compressed

from _mebp_utils import add_lora, tiny_llama, tokens


def tiny_gemma3_config():
    import transformers as tf

    return tf.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)


def _with_dequantized_weights(original: nn.Module, converted: nn.Module) -> nn.Module:
    """``original`` with every weight that ``converted`` compressed replaced by its round trip."""
    reference = copy.deepcopy(original)
    for name, module in converted.named_modules():
        if isinstance(module, (CompressedLinear, CompressedEmbedding)):
            weight = module.fmt.dequantize(module.packed(), module.group_size, torch.float32)
            reference.get_submodule(name).weight.data.copy_(weight)
    return reference


@pytest.mark.parametrize("build", ["apply_mebp", "load_compressed"])
def test_gemma3_scaled_embedding_is_compressed_and_keeps_its_scale(build: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(tiny_gemma3_config()).float().eval()
    if build == "apply_mebp":
        model = apply_mebp(copy.deepcopy(original), fmt="int4", group_size=32, checkpoint=False)
    else:
        model = load_compressed(tiny_gemma3_config(), fmt="int4", group_size=32, checkpoint=False)
        original = copy.deepcopy(original)
        original.load_state_dict(model.state_dict(), strict=False)  # norms etc.; weights come below
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, CompressedEmbedding)
    assert embedding.embed_scale.item() == pytest.approx(64**0.5)
    reference = _with_dequantized_weights(original, model)
    ids = tokens(vocab=128)
    with torch.no_grad():
        torch.testing.assert_close(model.get_input_embeddings()(ids), reference.get_input_embeddings()(ids), rtol=0, atol=0)
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_subclass_of_linear_is_found_and_one_that_changes_forward_is_left_alone() -> None:
    class PlainSubclass(nn.Linear):
        pass

    class Doubling(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = tiny_llama(num_layers=2)
    mlp = model.model.layers[0].mlp
    mlp.up_proj = PlainSubclass(64, 128, bias=False)
    mlp.gate_proj = Doubling(64, 128, bias=False)
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.mlp\.gate_proj \(Doubling\)"):
        apply_mebp(model, fmt="int4", group_size=32)
    assert isinstance(mlp.up_proj, CompressedLinear)
    assert type(mlp.gate_proj) is Doubling


def test_trainable_weights_of_a_model_set_up_for_fine_tuning_stay_trainable() -> None:
    """A model with frozen and trainable parameters: the trainable Linears are skipped, once warned."""
    model = tiny_llama(num_layers=2).requires_grad_(False)
    trained = model.model.layers[1].self_attn.o_proj.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"left 1 trainable module.*model\.layers\.1\.self_attn\.o_proj") as record:
        apply_mebp(model, fmt="int4", group_size=32)
    assert len([w for w in record if "trainable" in str(w.message)]) == 1
    assert model.model.layers[1].self_attn.o_proj is trained and trained.weight.requires_grad
    assert isinstance(model.model.layers[0].self_attn.o_proj, CompressedLinear)


def test_a_fresh_model_with_every_parameter_trainable_is_compressed_whole() -> None:
    """Nothing frozen yet (straight from ``from_pretrained``): it is taken as not set up, all is compressed."""
    model = apply_mebp(tiny_llama(num_layers=2), fmt="int4", group_size=32)
    layer = model.model.layers[0]
    assert all(isinstance(m, CompressedLinear) for m in (layer.self_attn.q_proj, layer.mlp.down_proj, model.lm_head))


def test_peft_model_keeps_lora_layers_float_and_compresses_their_base() -> None:
    model = apply_mebp(add_lora(tiny_llama(num_layers=2)), fmt="int4", group_size=32)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, CompressedLinear)
    assert type(q_proj.lora_A["default"]) is nn.Linear and q_proj.lora_A["default"].weight.requires_grad


def test_bitsandbytes_linear4bit_is_never_compressed_again() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    model = tiny_llama(num_layers=2)
    old = model.model.layers[0].mlp.up_proj
    quantized = bnb.nn.Linear4bit(64, 128, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    quantized.load_state_dict(old.state_dict())
    model.model.layers[0].mlp.up_proj = quantized.to("cpu")
    apply_mebp(model, fmt="int4", group_size=32)
    assert model.model.layers[0].mlp.up_proj is quantized
    assert isinstance(model.model.layers[0].mlp.down_proj, CompressedLinear)


def test_a_model_with_nothing_to_compress_is_refused_before_any_change() -> None:
    model = tiny_llama(num_layers=2)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match=r"found no `nn.Linear` to compress in the 2 blocks of LlamaForCausalLM"):
        apply_mebp(model, fmt="int4", group_size=32, compress_embeddings=False,
                   ignore_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
