"""Heap trims in a recipe run: inside each step by the blocks' wrappers (float or compressed), after batches by HeapTrim."""

from __future__ import annotations

from pathlib import Path

import pytest
from _recipes_utils import FAST, compose_cfg, one_thread  # noqa: F401

from lcsb_lightning import heap_trim
from lcsb_lightning.mebp._internal import checkpoint
from lcsb_lightning.recipes.train import run_finetune


@pytest.mark.parametrize("mebp", ["none", "int4"])
def test_heap_is_trimmed_inside_the_steps_and_after_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mebp: str) -> None:
    calls = {"block": 0, "whole": 0}
    monkeypatch.setattr(checkpoint, "trim_heap_if_grown", lambda *a, **k: calls.__setitem__("block", calls["block"] + 1))
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: calls.__setitem__("whole", calls["whole"] + 1))
    overrides = [*FAST, f"mebp={mebp}"] + (["mebp.group_size=32"] if mebp != "none" else [])
    run_finetune(compose_cfg(overrides), tmp_path)
    assert calls["whole"] >= 4  # after each of the 4 training batches, and around the evaluations
    assert calls["block"] >= 4 * 2  # around each of the tiny model's 2 blocks in each training step
