"""GGUFSource streams: row ranges dequantized from the memory map equal gguf + transformers on the whole tensor."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from _mebp_utils import gguf_model, tokens, write_tiny_gguf
from torch import nn

from lcsb_lightning.mebp import apply_mebp, load_compressed, loading
from lcsb_lightning.mebp._internal import sources
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear
from lcsb_lightning.mebp._internal.sources import GGUF_ARCHITECTURES, GGUFSource, gguf_quant_types

QUANTS = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _reference(tensor: Any, arch: str, config: Any) -> torch.Tensor:
    """What transformers' GGUF loader makes of a file tensor: gguf dequantizes it whole, then its processor."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    processor = hf_gguf.TENSOR_PROCESSORS.get(arch, hf_gguf.TensorProcessor)(
        config={"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    )
    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.copy(processor.process(weights=weights, name=tensor.name).weights))


def _ranges(rows: int) -> list[tuple[int, int]]:
    """The whole tensor, single rows, ranges crossing the rotary-half (32) and head (64) boundaries of
    the permuted Q/K rows, and consecutive 24-row chunks as the loader asks for them."""
    fixed = [(0, rows), (0, 1), (rows - 1, rows), (20, 45), (50, 80), (31, 97)]
    return [(a, b) for a, b in fixed if b <= rows] + [(a, min(a + 24, rows)) for a in range(0, rows, 24)]


@pytest.mark.parametrize("quant", QUANTS)
def test_rows_equal_whole_tensor_dequantization(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str) -> None:
    model = gguf_model("llama", tie=False)
    write_tiny_gguf(model, tmp_path / "tiny.gguf", quant)
    monkeypatch.setattr(sources, "DEQUANTIZE_ELEMENTS", 5 * 256)  # several ragged gguf calls per range
    source = GGUFSource(tmp_path / "tiny.gguf", model)
    assert {t.tensor_type.name for n, t in source.tensors.items() if n.endswith("proj.weight")} == {quant}
    assert len(source._heads) == 4  # the q and k projections of both layers are read permuted
    for name, param in model.named_parameters():
        expected = _reference(source.tensors[name], "llama", model.config)
        for start, stop in _ranges(param.shape[0]) if param.dim() == 2 else [(0, param.shape[0])]:
            got = source.rows(name, param.shape, start, stop)
            assert got.dtype == torch.float32 and torch.equal(got, expected[start:stop]), (name, start, stop)


def _compressed(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (m.weight, m.scales) for n, m in model.named_modules() if isinstance(m, (CompressedLinear, CompressedEmbedding))}


@pytest.mark.parametrize(
    ("arch", "quant", "tie"),
    [("llama", "Q8_0", False), ("llama", "Q4_K", True), ("qwen2", "Q6_K", True), ("gemma2", "Q5_K", True),
     ("gemma3", "Q8_0", True)],
)
def test_load_compressed_equals_compressing_the_transformers_gguf_load(tmp_path: Path, arch: str, quant: str, tie: bool) -> None:
    """Same codes, scales, float parameters and logits as transformers' own GGUF loader + apply_mebp."""
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(gguf_model(arch, tie=tie), tmp_path / "tiny.gguf", quant, arch=arch)
    ours = load_compressed(tmp_path / "tiny.gguf", fmt="int4", group_size=32)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    reference = apply_mebp(loaded, fmt="int4", group_size=32)
    assert type(ours) is type(reference) and (ours.lm_head.weight is ours.model.embed_tokens.weight) is tie
    ours_packed, reference_packed = _compressed(ours), _compressed(reference)
    assert ours_packed.keys() == reference_packed.keys() and len(ours_packed) == 2 * 7 + 2
    for module, (codes, scales) in ours_packed.items():
        assert torch.equal(codes, reference_packed[module][0]) and torch.equal(scales, reference_packed[module][1]), module
    floats, reference_floats = ours.state_dict(), reference.state_dict()  # norms (Gemma: minus one), biases
    assert floats.keys() == reference_floats.keys()
    assert all(torch.equal(floats[k], reference_floats[k]) for k in floats)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()).logits, reference(tokens()).logits)


def test_llama_file_named_mistral_loads_as_mistral_with_the_llama_layout(tmp_path: Path) -> None:
    """transformers makes a ``llama`` GGUF named ``mistral`` a Mistral model, and then (5.24) fails to map
    its tensor names (gguf has no ``mistral`` architecture); the names and the Q/K permutation follow
    the file's architecture here, so it loads the same weights as the file named otherwise."""
    model = gguf_model("llama")
    write_tiny_gguf(model, tmp_path / "llama.gguf", "Q4_1")
    write_tiny_gguf(model, tmp_path / "mistral.gguf", "Q4_1", name="mistral")
    as_llama = load_compressed(tmp_path / "llama.gguf", fmt="int4", group_size=32)
    as_mistral = load_compressed(tmp_path / "mistral.gguf", fmt="int4", group_size=32)
    assert type(as_llama).__name__ == "LlamaForCausalLM" and type(as_mistral).__name__ == "MistralForCausalLM"
    llama_packed, mistral_packed = _compressed(as_llama), _compressed(as_mistral)
    assert all(torch.equal(llama_packed[k][0], mistral_packed[k][0]) for k in llama_packed)
    with torch.no_grad():
        torch.testing.assert_close(as_mistral(tokens()).logits, as_llama(tokens()).logits)


def test_loading_memory_is_one_chunk_of_floats_plus_packed_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak memory of the GGUF source while ``load_compressed`` runs.

    What is measured: every ``GGUFSource.rows`` call is wrapped; ``tracemalloc`` (which sees numpy's
    buffers: the gathered packed rows, gguf's outputs and temporaries, and the returned chunk, which
    torch shares with numpy) gives the peak allocated during the call above the traced memory before
    it, and what is still allocated after it. Torch's own allocations (the quantizer's) are not
    traced, so the spy also records the returned tensor: the float weights handed to the quantizer
    are at most one chunk, and the source keeps nothing between calls (what stays allocated is the
    returned chunk only). The memory-mapped file pages are file-backed, not heap, and are not counted.

    Asserted bound, per call: ``largest packed tensor + one chunk of float32 + slack``, with slack =
    32 KiB (Python objects and index arrays; gguf's working memory fits in it). With chunks of 24 rows
    (6144 weights) and the 512 x 256 Q8_0 MLP weights (139264 packed bytes) that is
    139264 + 24576 + 32768 = 196608 bytes; measured here: 63503 bytes (a permuted q_proj chunk). Asserted
    too, tighter: ``one chunk + 6 x DEQUANTIZE_ELEMENTS float32`` (73728 bytes; gguf's dequantize of
    one call holds about 4.5 float32 copies of it), so no packed tensor is ever copied to the heap.
    The previous source, which dequantized a whole tensor and copied it, peaked at 1129835 bytes on
    the MLP weights and kept 501526 bytes between calls: it fails both.
    """
    chunk, dequantize_elements, slack = 24 * 256, 2048, 32 * 1024
    monkeypatch.setattr(loading, "LOAD_CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(sources, "DEQUANTIZE_ELEMENTS", dequantize_elements)
    model = gguf_model("llama", tie=False)
    write_tiny_gguf(model, tmp_path / "tiny.gguf", "Q8_0")
    packed = max(t.n_bytes for t in gguf.GGUFReader(tmp_path / "tiny.gguf").tensors)
    calls: list[dict[str, Any]] = []
    rows = GGUFSource.rows

    def spy(self: GGUFSource, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = rows(self, name, shape, start, stop)
        after, peak = tracemalloc.get_traced_memory()
        calls.append({"name": name, "shape": tuple(shape), "peak": peak - before, "kept": after - before,
                      "returned": out.numel() * out.element_size()})
        return out

    monkeypatch.setattr(GGUFSource, "rows", spy)
    tracemalloc.start()
    try:
        load_compressed(tmp_path / "tiny.gguf", fmt="int4", group_size=32)
    finally:
        tracemalloc.stop()
    matrices = [c for c in calls if len(c["shape"]) == 2]
    assert max(c["returned"] for c in matrices) == chunk * 4 and packed == 512 * 256 // 32 * 34
    peak = max(c["peak"] for c in calls)
    assert peak <= packed + chunk * 4 + slack, peak
    assert peak <= chunk * 4 + 6 * dequantize_elements * 4, peak
    assert all(c["kept"] <= c["returned"] + 4096 for c in calls), max(c["kept"] - c["returned"] for c in calls)


def test_unsupported_quant_type_fails_before_any_tensor_is_read(tmp_path: Path) -> None:
    model = gguf_model("llama")
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(model, path, "Q8_0", types={"token_embd.weight": "Q8_1"})  # gguf cannot dequantize Q8_1
    match = (r"GGUF tensor `token_embd.weight` \(parameter `model.embed_tokens.weight`\) has type Q8_1, which the "
             r"installed gguf package cannot dequantize; supported types: F32, F16, .*Q4_K")
    with pytest.raises(ValueError, match=match):
        GGUFSource(path, model)
    with pytest.raises(ValueError, match=match):
        load_compressed(path, fmt="int4", group_size=32)
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"} <= set(gguf_quant_types())
    assert "Q8_1" not in gguf_quant_types()


@pytest.mark.parametrize("arch", ["gemma", "phi3"])
def test_unsupported_architecture_fails_first(tmp_path: Path, arch: str) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = ", ".join(GGUF_ARCHITECTURES)
    with pytest.raises(ValueError, match=rf"GGUF architecture '{arch}' is not supported by `load_compressed`; "
                                         rf"supported architectures: {supported}\."):
        load_compressed(tmp_path / "other.gguf", fmt="int4", group_size=32)
