"""GGUF out without llama.cpp: the adapter file's keys, names, shapes, rotary order and scales; the refusals;
the merged file's copied bytes and merged tensors. llama.cpp itself judges both files in test_llama_cpp_export.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")
peft = pytest.importorskip("peft")

from lcsb_lightning.export import gguf_lora, save_gguf_adapter, save_merged_gguf  # noqa: E402
from lcsb_lightning.mebp._internal.gguf_file import GGUFFile  # noqa: E402
from lcsb_lightning.mebp._internal.sources import GGUFSource  # noqa: E402
from lcsb_lightning.mebp.loading import load_float  # noqa: E402
from _mebp_utils import gguf_model, write_tiny_gguf  # noqa: E402


def _lora(model: nn.Module, seed: int = 1, **config: Any) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **config}
    peft_model = get_peft_model(model, LoraConfig(**settings))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return peft_model


@pytest.fixture()
def base_file(tmp_path: Path) -> tuple[Path, nn.Module]:
    """A tiny llama GGUF written as llama.cpp's converter writes one (Q/K rows permuted), and the float model
    read back from it (the base the adapter trains on)."""
    path = tmp_path / "base.gguf"
    write_tiny_gguf(gguf_model("llama", tie=True), path, quant="Q8_0")
    return path, load_float(path)


def _peft_deltas(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{base module name: scaling · B A}`` in Hugging Face row order, as peft computes it."""
    from peft.tuners.lora import LoraLayer

    return {name: (m.lora_B["default"].weight @ m.lora_A["default"].weight * m.scaling["default"]).detach()
            for name, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


def _file_deltas(path: Path, model: nn.Module) -> dict[str, np.ndarray]:
    """What llama.cpp adds to each base tensor, ``alpha / r · B A`` from the adapter file, put back in
    Hugging Face row order with the base loader's own row map."""
    reader = gguf.GGUFReader(str(path))
    alpha = float(reader.get_field("adapter.lora.alpha").contents())
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    source = GGUFSource(GGUFFile(path.parent / "base.gguf"), load_float(path.parent / "base.gguf"))
    deltas = {}
    for hf_name in _peft_deltas(model):
        gguf_name = source.tensors[f"{hf_name}.weight"].name
        a, b = tensors[f"{gguf_name}.lora_a"], tensors[f"{gguf_name}.lora_b"]
        delta = alpha / a.shape[0] * (b @ a)
        rows = source._file_rows(f"{hf_name}.weight", delta.shape[0], 0, delta.shape[0])
        deltas[hf_name] = delta if rows is None else delta[rows]
    return deltas


def test_adapter_file_has_llama_cpps_keys_names_and_shapes(base_file: tuple[Path, nn.Module], tmp_path: Path) -> None:
    path, model = base_file
    peft_model = _lora(model)
    out = save_gguf_adapter(peft_model, path, tmp_path / "adapter.gguf")
    reader = gguf.GGUFReader(str(out))
    assert reader.get_field("general.type").contents() == "adapter"
    assert reader.get_field("general.architecture").contents() == "llama"
    assert reader.get_field("adapter.type").contents() == "lora"
    assert reader.get_field("adapter.lora.alpha").contents() == pytest.approx(8.0)
    base = {t.name: tuple(int(d) for d in t.shape) for t in GGUFFile(path).tensors}
    names = {t.name: t for t in reader.tensors}
    assert len(names) == 2 * 7 * 2  # seven projections in two blocks, A and B each
    for name, tensor in names.items():
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        stem, _, part = name.rpartition(".")
        in_features, out_features = base[stem]
        assert tuple(int(d) for d in tensor.shape) == ((in_features, 4) if part == "lora_a" else (4, out_features))


@pytest.mark.parametrize(
    ("case", "config"),
    [
        ("plain", {}),
        ("q and k only", {"target_modules": ["q_proj", "k_proj"]}),
        ("rsLoRA", {"use_rslora": True}),
        ("rank and alpha patterns", {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"o_proj": 3.0}}),
    ],
)
def test_adapter_adds_what_peft_adds_in_hugging_face_order(base_file: tuple[Path, nn.Module], tmp_path: Path,
                                                           case: str, config: dict[str, Any]) -> None:
    path, model = base_file
    peft_model = _lora(model, **config)
    save_gguf_adapter(peft_model, path, tmp_path / "adapter.gguf")
    expected, written = _peft_deltas(peft_model), _file_deltas(tmp_path / "adapter.gguf", peft_model)
    assert written.keys() == expected.keys()
    for name, delta in expected.items():
        np.testing.assert_allclose(written[name], delta.numpy(), rtol=1e-5, atol=1e-7, err_msg=f"{case}: {name}")


def test_rslora_alpha_is_alpha_times_sqrt_r(base_file: tuple[Path, nn.Module]) -> None:
    path, model = base_file
    lora = gguf_lora(_lora(model, r=4, lora_alpha=8, use_rslora=True), path)
    assert lora.alpha == pytest.approx(8 * math.sqrt(4))


def test_rotary_order_is_what_the_base_file_holds(base_file: tuple[Path, nn.Module]) -> None:
    """B's rows of q and k go where the converter put the base weight's rows: a B equal to the layer's own
    weight (r = in) is written in the file's row order, byte for byte what the base file holds (Q8_0-rounded)."""
    path, model = base_file
    hf = {name: param.detach().clone() for name, param in model.named_parameters()}
    lora = gguf_lora(_lora(model, target_modules=["q_proj", "k_proj"]), path)
    permuted = {pair.gguf_name: pair for pair in lora.pairs}
    base = {t.name: t for t in GGUFFile(path).tensors}
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight")):
        from lcsb_lightning.mebp._internal.sources import rotary_order

        heads = 4 if "attn_q" in gguf_name else 2
        file_weight = gguf.quants.dequantize(base[gguf_name].data, base[gguf_name].tensor_type)
        np.testing.assert_array_equal(rotary_order(hf[hf_name].numpy(), heads), file_weight)
        assert permuted[gguf_name].b.shape[0] == file_weight.shape[0]


@pytest.mark.parametrize(
    ("case", "config", "message"),
    [
        ("LM head on a tied embedding", {"target_modules": ["q_proj", "lm_head"]}, "ties the LM head"),
        ("embedding adapter", {"target_modules": ["embed_tokens", "q_proj"]}, "embedding adapter"),
        ("modules_to_save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ("DoRA", {"use_dora": True}, "DoRA"),
        ("trained biases", {"bias": "all"}, "bias='all'"),
        ("added tokens", {"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ],
)
def test_refusals_name_the_reason_and_write_nothing(base_file: tuple[Path, nn.Module], tmp_path: Path, case: str,
                                                    config: dict[str, Any], message: str) -> None:
    path, model = base_file
    peft_model = _lora(model, **config)
    with pytest.raises(ValueError, match="llama.cpp") as error:
        save_gguf_adapter(peft_model, path, tmp_path / "adapter.gguf")
    assert message in str(error.value), case
    assert list(tmp_path.glob("adapter.gguf*")) == [] and list(tmp_path.glob(".adapter.gguf*")) == []


def test_a_resized_vocabulary_is_refused(base_file: tuple[Path, nn.Module], tmp_path: Path) -> None:
    path, model = base_file
    model.resize_token_embeddings(model.config.vocab_size + 2)
    with pytest.raises(ValueError, match="added tokens"):
        save_gguf_adapter(_lora(model, target_modules=["q_proj"]), path, tmp_path / "adapter.gguf")


def test_a_failed_write_keeps_the_previous_file(base_file: tuple[Path, nn.Module], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, model = base_file
    peft_model = _lora(model)
    out = save_gguf_adapter(peft_model, path, tmp_path / "adapter.gguf")
    before = out.read_bytes()
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", lambda self, **_: (_ for _ in ()).throw(OSError("disk full")))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_gguf_adapter(peft_model, path, out)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter.gguf", "base.gguf"]


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0"])
def test_merged_file_copies_every_other_byte_and_merges_the_adapted_tensors(
        base_file: tuple[Path, nn.Module], tmp_path: Path, tensor_type: str) -> None:
    path, model = base_file
    peft_model = _lora(model, target_modules=["q_proj", "k_proj", "down_proj"])
    expected = {n: p.detach().clone() for n, p in peft_model.merge_and_unload(safe_merge=True).named_parameters()}
    peft_model = _lora(load_float(path), target_modules=["q_proj", "k_proj", "down_proj"])
    merged = save_merged_gguf(peft_model, path, tmp_path / "merged.gguf", tensor_type=tensor_type)

    base, out = GGUFFile(path), GGUFFile(merged)
    assert bytes(out._map[slice(*out.metadata_span)]) == bytes(base._map[slice(*base.metadata_span)])
    adapted = {pair.gguf_name for pair in gguf_lora(peft_model, path).pairs}
    assert len(adapted) == 6
    for old, new in zip(base.tensors, out.tensors, strict=True):
        assert (new.name, new.shape) == (old.name, old.shape)
        if new.name in adapted:
            assert new.tensor_type.name == tensor_type
        else:
            assert new.tensor_type == old.tensor_type and bytes(new.data) == bytes(old.data)
    reread = dict(load_float(merged).named_parameters())
    tolerance = 2e-3 if tensor_type == "F16" else 2e-2  # relative to the largest weight
    for name, weight in expected.items():
        scale = float(weight.abs().max())
        torch.testing.assert_close(reread[name], weight, atol=tolerance * scale, rtol=0, msg=name)


def test_merged_rejects_an_unknown_type_before_writing(base_file: tuple[Path, nn.Module], tmp_path: Path) -> None:
    path, model = base_file
    with pytest.raises(ValueError, match="tensor_type='Q4_K'"):
        save_merged_gguf(_lora(model), path, tmp_path / "merged.gguf", tensor_type="Q4_K")
    assert not (tmp_path / "merged.gguf").exists()


def test_the_export_closes_the_base_file_it_opened(base_file: tuple[Path, nn.Module], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from lcsb_lightning.export import check_gguf_lora

    path, model = base_file
    peft_model = _lora(model)
    closed: list[str] = []
    original = GGUFFile.close
    monkeypatch.setattr(GGUFFile, "close", lambda self: (closed.append(self.path), original(self))[1])
    check_gguf_lora(peft_model, path)
    save_gguf_adapter(peft_model, path, tmp_path / "adapter.gguf")
    save_merged_gguf(peft_model, path, tmp_path / "merged.gguf")
    assert closed == [str(path)] * 3
