"""The recipes' HeapTrim: trims before blocks and after batches while training, leaves no hook behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _recipes_utils import FAST, compose_cfg, one_thread  # noqa: F401

from lcsb_lightning.mebp._internal import heap
from lcsb_lightning.recipes.progress import HeapTrim
from lcsb_lightning.recipes.train import run_finetune


@pytest.mark.parametrize(("mebp", "hooked"), [("none", True), ("int4", False)])
def test_heap_is_trimmed_during_the_run_and_the_hooks_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mebp: str,
                                                        hooked: bool) -> None:
    calls = {"block": 0, "whole": 0}
    monkeypatch.setattr(heap, "maybe_release_free_heap", lambda *a, **k: calls.__setitem__("block", calls["block"] + 1))
    monkeypatch.setattr(heap, "release_free_heap", lambda: calls.__setitem__("whole", calls["whole"] + 1))
    installed: list[int] = []
    setup = HeapTrim.setup

    def recording_setup(self: HeapTrim, *args: Any, **kwargs: Any) -> None:
        setup(self, *args, **kwargs)
        installed.append(len(self._handles))

    monkeypatch.setattr(HeapTrim, "setup", recording_setup)
    overrides = [*FAST, f"mebp={mebp}"] + (["mebp.group_size=32"] if mebp != "none" else [])
    run_finetune(compose_cfg(overrides), tmp_path)
    assert calls["whole"] >= 4  # after each of the 4 training batches, and around the evaluations
    # the float model's blocks trim through HeapTrim (its 2 blocks); the plugin's release_heap does it for a compressed one
    assert (max(installed) > 0) is hooked and (calls["block"] > 0) is hooked
