"""The memory study's configurations run end to end on a tiny shape, each in its fresh process (seconds each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lcsb_lightning.bench import memory

VOCAB = 32768  # a 1.3 MB compressed embedding: the census's frozen weights are visible at the report's 0.1 MB
TINY_QWEN2 = {
    "_target_": "transformers.Qwen2Config", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
}
#: The compressed weights (int4, group 32: half a byte per weight and a 4-byte scale per 32) in MB.
COMPRESSED_MB = (VOCAB * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)) * (0.5 + 4 / 32) / 2**20


def spec(options: dict) -> dict:
    return {"arm": "mebp", "model_config": TINY_QWEN2, "options": {"group_size": 32, **options}, "seq_len": 16,
            "rank": 4, "warmup": 1, "steps": 1}


@pytest.mark.parametrize("options", [{"weights": "mmap"}, {"offload": "mmap", "weights": "ram"}])
def test_a_configuration_reports_the_anchors_metric_and_a_breakdown_of_its_peak(tmp_path: Path, options: dict) -> None:
    figures = memory.measure(spec(options), tmp_path / "memory.json", timeout=600)
    assert figures["options"] == {"group_size": 32, **options}
    assert 0 < figures["peak_anon_train_mb"] <= figures["peak_rss_above_import_mb"]
    assert figures["peak_rss_mb"] == pytest.approx(figures["rss_after_import_mb"] + figures["peak_rss_above_import_mb"], abs=0.2)
    found = figures["breakdown"]
    owners = found["owners_mb"]
    # the tiny model's LoRA (r4 on 7 projections x 2 blocks) and AdamW's two moments are counted exactly
    lora_mb = 2 * sum(4 * (i + o) for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]) * 4 / 2**20
    assert owners["lora_weights"] == pytest.approx(lora_mb, abs=0.05)
    assert owners["optimizer_state"] == pytest.approx(2 * lora_mb, abs=0.05)
    assert found["window"].startswith(("forward block", "backward block", "loss", "optimizer step", "step start"))
    # the frozen weights in anonymous memory: the compressed model in RAM, none of it memory-mapped
    expected = COMPRESSED_MB if options["weights"] == "ram" else 0.0
    assert owners["weights_anon"] == pytest.approx(expected, abs=0.06), (owners, expected)
    assert figures["heap_trims_per_step"] and all(t >= 0 for t in figures["heap_trims_per_step"])


def test_the_breakdown_splits_the_peak_window_and_the_slack_of_the_headline() -> None:
    windows = [
        {"window": "forward block 0", "start_anon": 110.0, "peak_anon": 130.0, "owners": {"lora_weights": 5.0}},
        {"window": "backward block 1", "start_anon": 120.0, "peak_anon": 150.0, "owners": {"lora_weights": 5.0, "lora_grads": 2.0}},
        {"window": "optimizer step", "start_anon": 115.0, "peak_anon": 125.0, "owners": {"lora_weights": 5.0}},
    ]
    found = memory.breakdown(windows, baseline_anon=100.0, runtime=3.0, headline_peak=60.0)
    assert found["window"] == "backward block 1"  # the window holding the trimmed step's peak (150 - 100 = 50 MB)
    assert found["owners_mb"] == {"lora_weights": 5.0, "lora_grads": 2.0, "runtime objects": 3.0,
                                  "working set (backward)": 30.0, "allocator slack": 10.0}
    assert found["unaccounted_mb"] == 50.0 - (5.0 + 2.0 + 3.0 + 30.0)
    assert found["accounted"] == round(1 - 10.0 / 60.0, 3)


def test_the_peak_sampler_sees_an_allocation_that_lives_between_two_reads() -> None:
    import time

    import torch

    sampler = memory.RunMemory(period_s=0.001)
    try:
        before, _ = sampler.mark()
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        time.sleep(0.05)
        del block
        peak, now = sampler.mark()
    finally:
        sampler.close()
    assert peak - now > 48


def test_the_lean_configuration_measured_is_the_phone_budget_recipe() -> None:
    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[1]
    recipe = OmegaConf.load(root / "recipes" / "phone_budget.yaml").mebp
    lean = OmegaConf.load(root / "conf" / "benchmark" / "memory_anchor.yaml").memory.configs.lean
    assert OmegaConf.to_container(recipe) == OmegaConf.to_container(lean)
