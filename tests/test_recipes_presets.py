"""The presets (wikitext2, gsm8k, sst2): hub loading through ``datasets`` (offline, on hub-style folders
written here), local files under ``data_dir``, and one clear message for each way the data can be missing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from _recipes_utils import FAST, SHARED_DATA, compose_cfg, one_thread  # noqa: F401
from lcsb_lightning.recipes.train import build, run_finetune

needs_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(),
    reason=f"{SHARED_DATA} is not here (CI puts ../shared beside the clone; a user's data comes from the hub)",
)

PRESETS = {
    "wikitext2": ["task.max_chars=20000", "task.max_eval_examples=4"],
    "gsm8k": ["task.max_train_examples=16", "task.max_eval_examples=4", "task.num_generate=1", "task.max_new_tokens=4",
              "seq_len=512"],  # byte tokens: a GSM8K question is 200-400 of them
    "sst2": ["task.max_train_examples=32", "task.max_eval_examples=8", "seq_len=64"],
}
# ../shared/data has no WikiText-2 train split: train on valid.txt there (a development convenience)
SHARED_OVERRIDES = {"wikitext2": ["task.train_files=[wikitext-2/valid.txt]"]}
METRIC = {"wikitext2": "val/ppl", "gsm8k": "val/exact_match", "sst2": "val/accuracy"}


@needs_shared_data
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_runs_on_local_files_under_data_dir(name: str, tmp_path: Path) -> None:
    cfg = compose_cfg([*FAST, f"task={name}", f"data_dir={SHARED_DATA}", *SHARED_OVERRIDES.get(name, []), *PRESETS[name]])
    summary = run_finetune(cfg, tmp_path)
    assert summary["steps"] == 4
    assert METRIC[name] in summary["final_metrics"]
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------------------ hub, offline
def _hub_folder(root: Path, config: str, splits: dict[str, list[dict[str, Any]]]) -> Path:
    """A local folder laid out as a hub data set repository: parquet per split, configs in README.md."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / config).mkdir(parents=True)
    lines = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), root / config / f"{split}-00000-of-00001.parquet")
        lines += [f"  - split: {split}", f"    path: {config}/{split}-*.parquet"]
    (root / "README.md").write_text("\n".join([*lines, "---", ""]))
    return root


@pytest.fixture
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


TEXT_LINES = [" = Lobsters = \n", " The European lobster lives in the Atlantic . \n", "", " It is blue . \n"]


def test_wikitext2_from_the_hub_reads_train_and_test_as_one_document_each(tmp_path: Path, datasets_cache: None) -> None:
    folder = _hub_folder(tmp_path / "wikitext", "wikitext-2-v1",
                         {"train": [{"text": t} for t in TEXT_LINES * 20], "validation": [{"text": "x"}],
                          "test": [{"text": t} for t in TEXT_LINES * 5]})
    task = build(compose_cfg(["task=wikitext2", f"task.hub.path={folder}"]).task, _convert_="all")
    train, evals = task._documents()
    # the rows are the lines of each split's text (a blank line is an empty row, as in the hub's WikiText)
    assert train == ["\n".join(line.rstrip("\n") for line in TEXT_LINES * 20)]
    assert evals == ["\n".join(line.rstrip("\n") for line in TEXT_LINES * 5)]


def test_gsm8k_and_sst2_from_the_hub_run(tmp_path: Path, datasets_cache: None) -> None:
    qa = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(5) for b in range(4)]
    gsm8k = _hub_folder(tmp_path / "gsm8k", "main", {"train": qa[:16], "test": qa[16:]})
    summary = run_finetune(compose_cfg([*FAST, "task=gsm8k", f"task.hub.path={gsm8k}", "task.num_generate=1",
                                        "task.max_new_tokens=4", "seq_len=64"]), tmp_path / "qa")
    assert summary["train_examples"] == 16 and summary["eval_examples"] == 4
    sentences = [{"sentence": s, "label": y, "idx": i} for i, (s, y) in enumerate([("a fine film", 1), ("dull", 0)] * 6)]
    sst2 = _hub_folder(tmp_path / "glue", "sst2", {"train": sentences, "validation": sentences[:4], "test": sentences[:2]})
    summary = run_finetune(compose_cfg([*FAST, "task=sst2", f"task.hub.path={sst2}", "seq_len=32"]), tmp_path / "cls")
    assert summary["train_examples"] == 12 and summary["eval_examples"] == 4  # validation, not test
    assert "val/accuracy" in summary["final_metrics"]


# ------------------------------------------------------------------------- missing data
def test_missing_local_file_names_it_and_the_data_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nowhere/gsm8k/train.jsonl \(configured as 'gsm8k/train.jsonl' under data_dir="):
        build(compose_cfg(["task=gsm8k", f"data_dir={tmp_path}/nowhere"]).task, _convert_="all")


def test_missing_datasets_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    task = build(compose_cfg(["task=sst2"]).task, _convert_="all")
    with pytest.raises(ImportError, match=r"needs the `datasets` package: pip install 'lcsb-lightning\[recipes\]'"):
        task.build(tokenizer=None, seq_len=32)


def test_unreachable_hub_data_set_says_to_use_data_dir(tmp_path: Path, datasets_cache: None) -> None:
    task = build(compose_cfg(["task=gsm8k", f"task.hub.path={tmp_path}/no_such_dataset"]).task, _convert_="all")
    with pytest.raises(ConnectionError, match="without network, give data_dir= with local files"):
        task.build(tokenizer=None, seq_len=32)


def test_bad_hub_node_is_refused_before_any_download() -> None:
    with pytest.raises(ValueError, match=r"hub: needs `path` and takes only path, name, train_split"):
        build(compose_cfg(["task=sst2", "+task.hub.revision=main"]).task, _convert_="all")


def test_no_preset_reads_a_data_folder_by_default() -> None:
    hubs = {"wikitext2": "Salesforce/wikitext", "gsm8k": "openai/gsm8k", "sst2": "nyu-mll/glue"}
    for name, path in hubs.items():
        task = compose_cfg([f"task={name}"]).task
        assert task.data_dir is None and task.hub.path == path
