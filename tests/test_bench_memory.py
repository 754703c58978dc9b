"""The memory study's arms run end to end on a tiny shape, each in its fresh process (seconds each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lcsb_lightning.bench import memory

TINY_QWEN2 = {
    "_target_": "transformers.Qwen2Config", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
}


#: Upper bound on the memory a tiny-shape run adds to the bare torch import, in MiB (measured: about 35).
MODEL_AND_TRAINING_BOUND_MB = 200


def spec(arm: str, folder: Path | None) -> dict:
    return {"arm": arm, "model_config": TINY_QWEN2, "folder": str(folder) if folder else None, "fmt": "int4",
            "group_size": 32, "fraction": 0.5, "backward": "all_reached", "seq_len": 16, "rank": 4, "warmup": 1,
            "steps": 1, "malloc": "default"}


@pytest.mark.parametrize("arm", ["mebp", "mebp_lean", pytest.param("mebp_lcsb", marks=pytest.mark.slow),
                                 pytest.param("mebp_no_trim", marks=pytest.mark.slow)])
def test_mebp_arms_build_the_random_init_from_the_shape_config(tmp_path: Path, arm: str) -> None:
    figures = memory.measure(spec(arm, None), tmp_path / "memory.json", timeout=600)
    assert figures["arm"] == arm
    # torch alone makes a resident process of hundreds of MiB; loading the model (and the libraries it needs)
    # and then training it each raise the resident size
    assert 100 < figures["rss_after_import_mb"] < figures["rss_after_load_mb"] < figures["peak_rss_mb"]
    assert figures["model_and_training_mb"] == pytest.approx(figures["peak_rss_mb"] - figures["rss_after_import_mb"], abs=0.2)
    # The tiny model's weights, LoRA and AdamW state take under 2 MiB; what the run adds over the bare torch
    # import is Lightning's and the loader's imports and allocator slack (about 35 MiB measured), far under
    # this bound, which a unit slip (KiB read as MiB, x1024) or a baseline read before torch's import breaks.
    assert figures["model_and_training_mb"] < MODEL_AND_TRAINING_BOUND_MB
    assert figures["mebp/decompress_bwd_ms"] > 0
