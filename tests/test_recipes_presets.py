"""Each preset (wikitext2, gsm8k, sst2) runs briefly with the tiny model on ../shared/data when present."""

from __future__ import annotations

from pathlib import Path

import pytest

from _recipes_utils import FAST, SHARED_DATA, compose_cfg, one_thread  # noqa: F401
from lcsb_lightning.recipes.train import run_finetune

pytestmark = pytest.mark.skipif(
    not SHARED_DATA.is_dir(), reason=f"{SHARED_DATA} not present (the presets read data_dir=../shared/data)"
)

PRESETS = {
    "wikitext2": ["task.max_chars=20000", "task.max_eval_examples=4"],
    "gsm8k": ["task.max_train_examples=16", "task.max_eval_examples=4", "task.num_generate=1", "task.max_new_tokens=4",
              "seq_len=512"],  # byte tokens: a GSM8K question is 200-400 of them
    "sst2": ["task.max_train_examples=32", "task.max_eval_examples=8", "seq_len=64"],
}
METRIC = {"wikitext2": "val/ppl", "gsm8k": "val/exact_match", "sst2": "val/accuracy"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_runs_on_shared_data(name: str, tmp_path: Path) -> None:
    cfg = compose_cfg([*FAST, f"task={name}", f"data_dir={SHARED_DATA}", *PRESETS[name]])
    summary = run_finetune(cfg, tmp_path)
    assert summary["steps"] == 4
    assert METRIC[name] in summary["final_metrics"]
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_relative_data_dir_resolves_against_the_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # ../shared/data does not exist from here: the repository root is tried next
    summary = run_finetune(compose_cfg([*FAST, "task=sst2", *PRESETS["sst2"]]), tmp_path / "run")
    assert summary["train_examples"] == 32
