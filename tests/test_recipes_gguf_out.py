"""A recipe run on a GGUF base model writes its adapters as GGUF too (and merged.gguf when asked); what
llama.cpp could not apply is refused before training."""

from __future__ import annotations

from pathlib import Path

import pytest
from _recipes_utils import FAST, compose_cfg, one_thread  # noqa: F401
from test_recipes_compressed_load import _run_overrides, _tiny_smollm2

from lcsb_lightning.export import gguf_lora
from lcsb_lightning.mebp._internal.gguf_file import GGUFFile
from lcsb_lightning.recipes.train import prepare, run_finetune

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("mebp", ["none", "auto"])
def test_a_gguf_run_writes_gguf_adapters_beside_its_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mebp: str) -> None:
    cache = _tiny_smollm2(tmp_path, monkeypatch)
    out = tmp_path / "run"
    summary = run_finetune(compose_cfg([*_run_overrides(cache, mebp), "export.merged=true"]), out)
    for name in ("adapter.gguf", "adapter_best.gguf"):
        reader = gguf.GGUFReader(str(out / name))
        assert reader.get_field("general.type").contents() == "adapter"
        assert len(reader.tensors) == 2 * 7 * 2  # A and B of seven projections in two blocks
    merged, base = GGUFFile(out / "merged.gguf"), GGUFFile(tmp_path / "smol.gguf")
    assert [t.name for t in merged.tensors] == [t.name for t in base.tensors]
    assert summary["gguf"] == {"base": str(tmp_path / "smol.gguf"), "adapter": str(out / "adapter.gguf"),
                               "merged": str(out / "merged.gguf")}


def test_the_adapter_gguf_is_the_trained_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """adapter.gguf holds the final adapter/ folder's weights (not the best evaluation's, nor an untrained one)."""
    import numpy as np
    from peft import PeftModel

    from lcsb_lightning.mebp.loading import load_float

    cache = _tiny_smollm2(tmp_path, monkeypatch)
    out = tmp_path / "run"
    run_finetune(compose_cfg(_run_overrides(cache, "none")), out)
    trained = PeftModel.from_pretrained(load_float(tmp_path / "smol.gguf"), str(out / "adapter"))
    expected = {f"{p.gguf_name}.lora_b": p.b for p in gguf_lora(trained, tmp_path / "smol.gguf").pairs}
    written = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(out / "adapter.gguf")).tensors if t.name.endswith("lora_b")}
    assert written.keys() == expected.keys()
    assert any(np.abs(b).max() > 0 for b in written.values())  # trained: B starts at zero
    for name, b in expected.items():
        np.testing.assert_array_equal(written[name], b, err_msg=name)


def test_a_target_llama_cpp_cannot_apply_is_refused_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _tiny_smollm2(tmp_path, monkeypatch)
    cfg = compose_cfg([*_run_overrides(cache, "none"), "lora.target_modules=[q_proj,lm_head]"])
    with pytest.raises(ValueError, match="ties the LM head"):
        prepare(cfg)


def test_merged_needs_a_gguf_base(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="export.merged=true"):
        prepare(compose_cfg([*FAST, "export.merged=true"]))


def test_an_unknown_merged_type_is_refused_with_the_config() -> None:
    from lcsb_lightning.recipes.config import check_config

    with pytest.raises(ValueError, match="export.merged_type='Q4_K': allowed: F16, Q8_0"):
        check_config(compose_cfg([*FAST, "export.merged_type=Q4_K"]))
