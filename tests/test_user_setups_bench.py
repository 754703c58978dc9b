"""benchmarks/user_setups.py: every set-up trains with and without LCSB and lands in the side-by-side table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._benchmark_scripts import load_benchmark_script


def load_script():
    return load_benchmark_script("user_setups")


# every set-up builds (the counting tests in test_cut_below.py cover what LCSB does in each); two run here
SETUPS = ["LoRA + trainable embedding", "LoRA + HF checkpointing (reentrant)"]


def test_every_setup_builds_a_model_with_something_to_train() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    script = load_script()
    config = {k: v for k, v in script.SHAPES["tiny"].items() if k not in ("seq_len", "batch_size")}
    for name, make in script.SETUPS.items():
        model = make(LlamaForCausalLM(LlamaConfig(**config)))
        assert any(p.requires_grad for p in model.parameters()), name


def test_a_tiny_round_prints_the_side_by_side_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script()
    result = script.main(["--shape", "tiny", "--rounds", "1", "--warmup", "0", "--out", str(tmp_path), "--setups", *SETUPS])
    out = capsys.readouterr().out
    assert list(result["seconds"]) == SETUPS
    for setup, arms in result["seconds"].items():
        assert len(arms["full"]) == len(arms["lcsb"]) == 1 and min(arms["full"] + arms["lcsb"]) > 0
        assert f"| {setup} |" in out
    assert json.loads((tmp_path / "results.json").read_text())["seconds"] == result["seconds"]
    assert "load average" in (tmp_path / "results.md").read_text()


def test_lcsb_kwargs_reach_the_callback_and_name_the_column(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lcsb_lightning

    built: list[str] = []

    class RecordingCallback(lcsb_lightning.LCSBCallback):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self.unreached)

    monkeypatch.setattr(lcsb_lightning, "LCSBCallback", RecordingCallback)
    script = load_script()
    result = script.main(["--shape", "tiny", "--rounds", "1", "--warmup", "0", "--setups", "LoRA",
                          "--lcsb-kwargs", '{"unreached": "implicit"}'])
    assert built == ["implicit"] and result["lcsb_kwargs"] == {"unreached": "implicit"}
    assert "`LCSBCallback(unreached='implicit')` s/step" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--lcsb-kwargs", "[1, 2]"], ["--lcsb-kwargs", "{not json"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        load_script().main(argv)
