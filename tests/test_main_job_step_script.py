"""benchmarks/main_job_step.py: its arms and its refusal of an empty run (the timings themselves are not tested)."""

from __future__ import annotations

import argparse

import pytest
from _benchmark_scripts import load_benchmark_script

script = load_benchmark_script("main_job_step")


@pytest.mark.parametrize(("text", "expected"), [
    ("0.9.1=module.chunked_loss=true,keep_activations=8", ("0.9.1", ["module.chunked_loss=true", "keep_activations=8"])),
    ("plain=keep_activations=null", ("plain", ["keep_activations=null"])),
])
def test_an_arm_is_a_label_and_its_overrides(text: str, expected: tuple[str, list[str]]) -> None:
    assert script.parse_arm(text) == expected


@pytest.mark.parametrize("text", ["no_equals", "=keep_activations=8", "label="])
def test_a_malformed_arm_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected LABEL=OVERRIDE"):
        script.parse_arm(text)


def test_nothing_to_time_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        script.main([])
    assert "give arms, --vocab-blocks, or both" in capsys.readouterr().err
