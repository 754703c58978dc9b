"""benchmarks/memory_side_by_side.py: arms parsed and checked, a tiny round run end to end (seconds)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests._benchmark_scripts import BENCHMARKS, load_benchmark_script

SCRIPT = BENCHMARKS / "memory_side_by_side.py"


def load_script():
    return load_benchmark_script("memory_side_by_side")


@pytest.mark.parametrize(("text", "match"), [
    ("nolabel", "expected LABEL=ARM"),
    ("x=mebp_fast", "expected LABEL=ARM"),
    ("x=mebp@/nonexistent", "holds no lcsb_lightning package"),
])
def test_bad_arms_are_refused(text: str, match: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        load_script().parse_arm(text)


def test_labels_may_contain_equals_signs_and_a_checkout_defaults_to_this_one() -> None:
    label, arm, checkout = load_script().parse_arm("release_heap=False=mebp_no_trim")
    assert (label, arm, Path(checkout)) == ("release_heap=False", "mebp_no_trim", SCRIPT.parents[1])


def test_a_tiny_round_prints_the_side_by_side_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load_script().main(["--shape", "tiny", "--rounds", "1", "--steps", "1", "--out", str(tmp_path),
                        "defaults=mebp", "lean=mebp_lean"])
    out = capsys.readouterr().out
    assert "| defaults |" in out and "| lean |" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["label"] for r in rows] == ["defaults", "lean"] and all(r["peak_rss_mb"] > 0 for r in rows)


def test_each_arm_imports_its_own_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m`` puts the working directory first on the path: the child must run in the checkout."""
    module = load_script()
    other = tmp_path / "other"
    (other / "lcsb_lightning").mkdir(parents=True)
    seen: list[tuple[str, str]] = []

    def fake_measure(spec: dict, out_json: Path, timeout: float | None = None) -> dict:
        import os

        seen.append((os.getcwd(), os.environ["PYTHONPATH"]))
        return {"peak_rss_mb": 1.0, "model_and_training_mb": 1.0, "rss_after_load_mb": 1.0, "step_s": 1.0}

    monkeypatch.setattr(module.memory, "measure", fake_measure)
    module.main(["--shape", "tiny", "--rounds", "1", "--out", str(tmp_path / "out"), f"old=mebp@{other}", "new=mebp"])
    assert seen == [(str(other.resolve()), str(other.resolve())), (str(SCRIPT.parents[1]), str(SCRIPT.parents[1]))]
