from __future__ import annotations

import pytest
import transformers as tf
from torch import nn

from lcsb_lightning.blocks import find_blocks, map_trainable_params

SMALL = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, max_position_embeddings=64)

# (config factory, model class, attribute path the blocks live at)
ARCHITECTURES = {
    "llama": (lambda: tf.LlamaConfig(**SMALL, intermediate_size=64, num_hidden_layers=3, num_key_value_heads=2), tf.LlamaForCausalLM),
    "qwen2": (lambda: tf.Qwen2Config(**SMALL, intermediate_size=64, num_hidden_layers=3, num_key_value_heads=2), tf.Qwen2ForCausalLM),
    "mistral": (lambda: tf.MistralConfig(**SMALL, intermediate_size=64, num_hidden_layers=3, num_key_value_heads=2), tf.MistralForCausalLM),
    "gemma": (lambda: tf.GemmaConfig(**SMALL, intermediate_size=64, num_hidden_layers=3, num_key_value_heads=2, head_dim=8), tf.GemmaForCausalLM),
    "gemma2": (lambda: tf.Gemma2Config(**SMALL, intermediate_size=64, num_hidden_layers=3, num_key_value_heads=2, head_dim=8), tf.Gemma2ForCausalLM),
    "gemma3": (lambda: tf.Gemma3TextConfig(**SMALL, intermediate_size=64, num_hidden_layers=3, num_key_value_heads=2, head_dim=8), tf.Gemma3ForCausalLM),
    "phi3": (lambda: tf.Phi3Config(**SMALL, intermediate_size=64, num_hidden_layers=3, num_key_value_heads=2, pad_token_id=0), tf.Phi3ForCausalLM),
    "gpt2": (lambda: tf.GPT2Config(vocab_size=64, n_embd=32, n_head=4, n_layer=3, n_positions=64), tf.GPT2LMHeadModel),
    "opt": (lambda: tf.OPTConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, ffn_dim=64, num_hidden_layers=3, word_embed_proj_dim=32, max_position_embeddings=64), tf.OPTForCausalLM),
    "gpt_neox": (lambda: tf.GPTNeoXConfig(**SMALL, intermediate_size=64, num_hidden_layers=3), tf.GPTNeoXForCausalLM),
    "falcon": (lambda: tf.FalconConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=3), tf.FalconForCausalLM),
}


@pytest.mark.parametrize("wrap_peft", [False, True], ids=["plain", "peft"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_find_blocks_hf_architectures(arch: str, wrap_peft: bool) -> None:
    make_config, model_cls = ARCHITECTURES[arch]
    model = model_cls(make_config())
    if wrap_peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    blocks = find_blocks(model)
    assert len(blocks) == 3
    assert len({type(b) for b in blocks}) == 1
    if wrap_peft:
        mapped = map_trainable_params(model)
        assert all(len(p) > 0 for p in mapped.params_per_block)
        assert all("lora_" in n for names in mapped.names_per_block for n in names)


def test_find_blocks_through_lightning_module_and_plain_model(residual_net) -> None:
    from tests.conftest import TokenLM, tiny_llama_peft

    assert len(find_blocks(TokenLM(tiny_llama_peft(num_layers=3)))) == 3
    net = residual_net(num_blocks=5)
    assert find_blocks(net) == list(net.stack)
    assert find_blocks(TokenLM(net)) == list(net.stack)


def test_blocks_override_by_path_and_callable(residual_net) -> None:
    net = residual_net(num_blocks=3)
    assert find_blocks(net, "stack") == list(net.stack)
    assert find_blocks(net, lambda m: m.stack[:2]) == list(net.stack[:2])


@pytest.mark.parametrize(
    ("model", "blocks", "match"),
    [
        (nn.Linear(2, 2), "auto", "tried the attributes model.layers.*Pass `blocks="),
        (nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])), "not.there", "does not name a non-empty nn.ModuleList"),
        (nn.Linear(2, 2), lambda m: [], "returned no blocks"),
    ],
)
def test_find_blocks_errors(model: nn.Module, blocks, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        find_blocks(model, blocks)


def test_map_trainable_params_reports_outside_and_rejects_frozen_blocks(residual_net) -> None:
    net = residual_net(num_blocks=3)
    net.head.requires_grad_(True)
    mapped = map_trainable_params(net)
    assert mapped.outside == ["head.weight", "head.bias"]
    assert [len(p) for p in mapped.params_per_block] == [4, 4, 4]
    net.stack.requires_grad_(False)
    with pytest.raises(ValueError, match="No trainable parameter inside any of the 3 blocks"):
        map_trainable_params(net)
