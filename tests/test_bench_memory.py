"""The memory study's configurations run end to end on a tiny shape, each in its fresh process (seconds each)."""

from __future__ import annotations

import re
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

#: The tiny model's LoRA weights (r4 on the seven projections x 2 blocks, float32) in MB: 0.03, which the
#: breakdown's 0.1 MB rounding shows as 0.0.
LORA_MB = 2 * sum(4 * (i + o) for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]) * 4 / 2**20


def spec(options: dict) -> dict:
    return {"arm": "mebp", "model_config": TINY_QWEN2, "options": {"group_size": 32, **options}, "seq_len": 16,
            "rank": 4, "warmup": 1, "steps": 1}


@pytest.mark.parametrize("options", [{"weights": "mmap"}, {"offload": "mmap", "weights": "ram"},
                                     {"weights": "mmap", "release_heap": False}])
def test_a_configuration_reports_the_anchors_metric_and_a_breakdown_of_its_peak(tmp_path: Path, options: dict) -> None:
    figures = memory.measure(spec(options), tmp_path / "memory.json", timeout=600)
    assert figures["options"] == {"group_size": 32, **options}
    assert figures["optimizer"] == "adamw"  # the study's default, recorded
    assert 0 < figures["peak_anon_train_mb"] <= figures["peak_rss_above_import_mb"]
    assert figures["peak_rss_mb"] == pytest.approx(figures["rss_after_import_mb"] + figures["peak_rss_above_import_mb"], abs=0.2)
    found = figures["breakdown"]
    owners = found["owners_mb"]
    # the tiny model's LoRA and AdamW's two moments are counted exactly
    assert owners["lora_weights"] == pytest.approx(LORA_MB, abs=0.05)
    assert owners["optimizer_state"] == pytest.approx(2 * LORA_MB, abs=0.05)
    assert found["window"].startswith(("forward block", "backward block", "loss", "optimizer step", "step start"))
    # the frozen weights in anonymous memory: the compressed model in RAM, none of it memory-mapped
    expected = COMPRESSED_MB if options["weights"] == "ram" else 0.0
    assert owners["weights_anon"] == pytest.approx(expected, abs=0.06), (owners, expected)
    # QuantizedMeBP's count of each step (warm-up and measured): release_heap trims at least once a step (before
    # the backward's recompute), and without it nothing trims
    trims = figures["heap_trims_per_step"]
    assert len(trims) == 2 and all(t == int(t) for t in trims), trims
    assert all(t >= 1 for t in trims) if options.get("release_heap", True) else trims == [0, 0], trims


def test_sgd_holds_no_optimizer_state(tmp_path: Path) -> None:
    # MeSP's optimizer: SGD without momentum keeps nothing beside the LoRA weights and their gradients
    # (rank 32: 0.25 MB of LoRA weights, which AdamW's 0.5 MB of moments would show)
    figures = memory.measure({**spec({"weights": "mmap"}), "rank": 32, "optimizer": "sgd"}, tmp_path / "memory.json", timeout=600)
    assert figures["optimizer"] == "sgd"
    owners = figures["breakdown"]["owners_mb"]
    assert owners["optimizer_state"] == 0.0 and owners["lora_weights"] == pytest.approx(8 * LORA_MB, abs=0.05)
    assert 0 < figures["peak_anon_train_mb"] <= figures["peak_rss_above_import_mb"]


@pytest.mark.parametrize("value", ["adam", "SGD", None, 3])
def test_an_unknown_optimizer_is_refused_before_the_process_starts(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match=r"optimizer must be one of \['adamw', 'sgd'\], got " + re.escape(repr(value))):
        memory.measure({**spec({}), "optimizer": value}, tmp_path / "memory.json", timeout=600)
    assert not (tmp_path / "memory.spec.json").exists()  # nothing written, no process started


def test_the_study_itself_refuses_an_unknown_optimizer_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_load", lambda spec: pytest.fail("loaded before the optimizer was checked"))
    with pytest.raises(ValueError, match=r"optimizer must be one of \['adamw', 'sgd'\], got 'adam'"):
        memory._run({**spec({}), "optimizer": "adam"})


MEMORY = {"rows": {"qwen2.5_0.5b": [128, 256], "qwen2.5_3b": [256]}, "configs": {"defaults": {}, "lean": {"offload": "mmap"}},
          "ablation_at": ["qwen2.5_0.5b", 256], "ablations": {"weights=ram": {"weights": "ram"}}, "rank": 8, "warmup": 1, "steps": 2}


def test_the_arms_without_optimizers_are_adamw_with_their_old_names() -> None:
    from lcsb_lightning.bench.spec import memory_arms

    arms = memory_arms(MEMORY)
    assert [a.name for a in arms] == [
        "qwen2.5_0.5b__128__defaults", "qwen2.5_0.5b__128__lean", "qwen2.5_0.5b__256__defaults", "qwen2.5_0.5b__256__lean",
        "qwen2.5_3b__256__defaults", "qwen2.5_3b__256__lean", "qwen2.5_0.5b__256__weights=ram"]
    assert all(a.labels["optimizer"] == "adamw" for a in arms)
    assert [a.name for a in memory_arms({**MEMORY, "optimizers": ["adamw"]})] == [a.name for a in arms]


def test_each_optimizer_runs_beside_adamw_and_only_the_others_are_named() -> None:
    from lcsb_lightning.bench.spec import memory_arms

    arms = memory_arms({**MEMORY, "rows": {"qwen2.5_3b": [256]}, "optimizers": ["adamw", "sgd"]})
    assert [a.name for a in arms] == [
        "qwen2.5_3b__256__defaults", "qwen2.5_3b__256__defaults__sgd", "qwen2.5_3b__256__lean", "qwen2.5_3b__256__lean__sgd",
        "qwen2.5_0.5b__256__weights=ram", "qwen2.5_0.5b__256__weights=ram__sgd"]
    assert arms[3].labels == {"shape": "qwen2.5_3b", "seq_len": 256, "config": "lean", "optimizer": "sgd"}
    only_sgd = memory_arms({**MEMORY, "ablations": None, "optimizers": ["sgd"]})
    assert {a.labels["optimizer"] for a in only_sgd} == {"sgd"} and only_sgd[0].name == "qwen2.5_0.5b__128__defaults__sgd"


@pytest.mark.parametrize(("optimizers", "match"), [
    (["adamw", "adam"], r"benchmark.memory.optimizers must be one of \['adamw', 'sgd'\], got 'adam'"),
    ("sgd", r"benchmark.memory.optimizers must be a non-empty list of \['adamw', 'sgd'\], got 'sgd'"),
    ([], r"benchmark.memory.optimizers must be a non-empty list of \['adamw', 'sgd'\], got \[\]"),
    (["sgd", "sgd"], r"benchmark.memory.optimizers names 'sgd' twice"),
])
def test_the_benchmark_refuses_bad_optimizers_before_any_arm_runs(optimizers: object, match: str) -> None:
    from lcsb_lightning.bench.runner import validate

    with pytest.raises(ValueError, match=match):
        validate({"studies": ["memory"], "memory": {**MEMORY, "optimizers": optimizers}})


def test_the_runner_passes_sgd_to_the_study_and_keeps_the_adamw_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    from lcsb_lightning.bench import runner
    from lcsb_lightning.bench.spec import load_result, memory_arms, settings_hash

    specs: list[dict] = []

    def fake_measure(spec: dict, out_json: Path, timeout: float | None = None) -> dict:
        specs.append(dict(spec))
        return {"optimizer": spec.get("optimizer", "adamw"), "peak_anon_train_mb": 1.0}

    monkeypatch.setattr(memory, "measure", fake_measure)
    m = {**MEMORY, "rows": {"qwen2.5_0.5b": [256]}, "configs": {"lean": {"offload": "mmap"}}, "ablations": None,
         "optimizers": ["adamw", "sgd"]}
    arms = memory_arms(m)
    runner._run_memory(arms, m, tmp_path, lambda overrides: OmegaConf.create({"model": {"config": TINY_QWEN2}}), {})
    adamw, sgd = specs
    assert "optimizer" not in adamw and sgd == {**adamw, "optimizer": "sgd"}
    # an AdamW arm's settings are those before the field existed: its finished results stay valid
    before = {"arm": "mebp", "model_config": TINY_QWEN2, "options": {"group_size": 64, "offload": "mmap"}, "seq_len": 256,
              "rank": 8, "warmup": 1, "steps": 2}
    assert load_result(tmp_path, arms[0], settings_hash(before)) is not None
    assert load_result(tmp_path, arms[1])["labels"]["optimizer"] == "sgd"


def test_the_report_names_the_optimizer_of_each_row() -> None:
    from lcsb_lightning.bench import report

    breakdown = {"window": "loss", "owners_mb": {"optimizer_state": 0.0}, "accounted": 0.9}
    figures = {"peak_anon_train_mb": 100.0, "peak_anon_load_mb": 50.0, "peak_rss_above_import_mb": 120.0, "peak_rss_mb": 500.0,
               "step_s": 1.0, "breakdown": breakdown}
    old = {"labels": {"shape": "qwen2.5_0.5b", "seq_len": 256, "config": "lean"}, **figures}  # before the field: AdamW
    new = {"labels": {"shape": "qwen2.5_0.5b", "seq_len": 256, "config": "lean", "optimizer": "sgd"}, **figures}
    rows = report.memory_rows([old, new], {"mesp": {"qwen2.5_0.5b": {256: 136.2}}})
    assert [r["optimizer"] for r in rows] == ["adamw", "sgd"] and rows[1]["mesp_mb"] == 136.2
    md = report.markdown({"memory": rows}, {"name": "x"})
    assert "| qwen2.5_0.5b | 256 | lean | adamw | 100 | 136.2 |" in md
    assert "| qwen2.5_0.5b | 256 | lean | sgd | 100 | 136.2 |" in md


def test_the_side_by_side_script_passes_its_optimizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests._benchmark_scripts import load_benchmark_script

    script = load_benchmark_script("memory_side_by_side")
    specs: list[dict] = []
    figures = {"peak_anon_train_mb": 1.0, "peak_anon_load_mb": 1.0, "peak_rss_above_import_mb": 1.0, "peak_rss_mb": 1.0,
               "step_s": 1.0, "breakdown": {}}
    monkeypatch.setattr(script.memory, "measure", lambda spec, out, timeout=None: specs.append(spec) or figures)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "")
    script.main(["--shape", "tiny", "--rounds", "1", "--optimizer", "sgd", "lean={}"])
    assert [s["optimizer"] for s in specs] == ["sgd"]
    with pytest.raises(SystemExit):
        script.main(["--optimizer", "adam", "lean={}"])


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
