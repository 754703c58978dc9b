"""The memory study's configurations run end to end on a tiny shape, each in its fresh process (seconds each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lcsb_lightning.bench import memory

TINY_QWEN2 = {
    "_target_": "transformers.Qwen2Config", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
}


def spec(options: dict) -> dict:
    return {"arm": "mebp", "model_config": TINY_QWEN2, "options": {"group_size": 32, **options}, "seq_len": 16,
            "rank": 4, "warmup": 1, "steps": 1}


@pytest.mark.parametrize("options", [{}, {"offload": "mmap", "weights": "ram"}])
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
    assert figures["peak_anon_train_mb"] == pytest.approx(sum(owners.values()) + found["unaccounted_mb"], abs=0.3)


def test_the_peak_sampler_sees_an_allocation_that_lives_between_two_reads() -> None:
    import time

    import torch

    sampler = memory.PeakSampler(period_s=0.001)
    try:
        before, _ = sampler.mark()
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        time.sleep(0.05)
        del block
        peak, now = sampler.mark()
    finally:
        sampler.close()
    assert peak - now > 48
