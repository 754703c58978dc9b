"""Reading task files through ``datasets`` and batching examples with a ``transformers`` collator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import ByT5Tokenizer

from lcsb_lightning.recipes.batching import IGNORE, PaddingCollator
from lcsb_lightning.recipes.data_io import read_table, read_text


def test_collate_pads_right_with_the_pad_id_and_ignored_labels() -> None:
    tok = ByT5Tokenizer()
    batch = [
        {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7], "prompt_ids": [5], "answer": "3"},
        {"input_ids": [8], "labels": [8], "prompt_ids": [], "answer": None},
    ]
    out = PaddingCollator(tok)(batch)
    pad = tok.pad_token_id
    assert torch.equal(out["input_ids"], torch.tensor([[5, 6, 7], [8, pad, pad]]))
    assert torch.equal(out["labels"], torch.tensor([[IGNORE, 6, 7], [8, IGNORE, IGNORE]]))
    assert torch.equal(out["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert all(out[k].dtype == torch.long for k in ("input_ids", "labels", "attention_mask"))
    assert out["prompt_ids"] == [[5], []] and out["answer"] == ["3", None]


def test_tables_keep_every_cell_as_written(tmp_path: Path) -> None:
    tsv = tmp_path / "t.tsv"
    tsv.write_text('sentence\tlabel\na "quoted" word \t1\n"open quote\t0\n007\tNA\n', encoding="utf-8")
    assert read_table(tsv) == (["sentence", "label"], [{"sentence": 'a "quoted" word ', "label": "1"},
                                                       {"sentence": '"open quote', "label": "0"},
                                                       {"sentence": "007", "label": "NA"}])
    csv = tmp_path / "t.csv"
    csv.write_text('text,y\n"a, ""b""",1\n', encoding="utf-8")
    assert read_table(csv, header=True) == (["text", "y"], [{"text": 'a, "b"', "y": "1"}])
    assert read_table(tsv, header=False)[1][0] == {"0": "sentence", "1": "label"}


def test_a_changed_file_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("first version\n", encoding="utf-8")
    assert read_text(path) == "first version\n"
    path.write_text("second version\n", encoding="utf-8")  # cached by datasets: the cache must notice
    assert read_text(path) == "second version\n"


def test_bad_json_lines_and_empty_files_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "qa.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n{"question": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"qa.jsonl is not valid JSON lines .*JSON parse error"):
        read_table(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.jsonl holds no rows"):
        read_table(empty)
