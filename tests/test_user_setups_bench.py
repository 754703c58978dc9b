"""benchmarks/user_setups.py: every set-up trains with and without LCSB and lands in the side-by-side table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "user_setups.py"


def load_script():
    spec = importlib.util.spec_from_file_location("user_setups", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_round_of_every_setup_prints_the_side_by_side_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script()
    result = script.main(["--shape", "tiny", "--rounds", "1", "--warmup", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert set(result["seconds"]) == set(script.SETUPS)
    for setup, arms in result["seconds"].items():
        assert len(arms["full"]) == len(arms["lcsb"]) == 1 and min(arms["full"] + arms["lcsb"]) > 0
        assert f"| {setup} |" in out
    assert json.loads((tmp_path / "results.json").read_text())["seconds"] == result["seconds"]
    assert "load average" in (tmp_path / "results.md").read_text()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        load_script().main(["--rounds", "0"])
