"""``classification``: texts scored by the log-likelihood of one verbalizer word per label."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lcsb_lightning.recipes.batching import IGNORE
from lcsb_lightning.recipes.data_io import column_name, read_table, require_file
from lcsb_lightning.recipes.tasks.base import Example, Task, TaskData, token_ids


class ClassificationTask(Task):
    """Text classification scored by the log-likelihood of a verbalizer word per label (``classification``).

    Args:
        train_file: TSV, CSV or JSONL file to train on.
        eval_file: File to evaluate on.
        text_column: Text column, by name or 0-based position.
        label_column: Label column, by name or position.
        verbalizer: Label value -> word, e.g. ``{"0": "negative", "1": "positive"}``.
        template: Prompt template with ``{text}``; the target is ``" " + word``.
        format: ``auto`` (from the extension), ``tsv``, ``csv`` or ``jsonl``.
        header: Whether the TSV/CSV files start with a header line.
        **kwargs: See :class:`Task`.
    """

    kind = "classification"
    eval_split = "eval"

    def __init__(self, train_file: str | None = None, eval_file: str | None = None, text_column: str | int = "sentence",
                 label_column: str | int = "label", verbalizer: Mapping[Any, str] | None = None,
                 template: str = "{text}\nSentiment:", format: str = "auto",  # noqa: A002 - the YAML key users write
                 header: bool = True, **kwargs: Any):
        super().__init__(**kwargs)
        if not verbalizer:
            raise ValueError("classification needs a verbalizer: {label value: word}")
        if "{text}" not in template:
            raise ValueError(f"template {template!r} must contain {{text}}")
        self.verbalizer = {str(k): str(v) for k, v in verbalizer.items()}
        self.labels = list(self.verbalizer)
        self.template, self.text_column, self.label_column = template, text_column, label_column
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self.source = self._source(bool(train_file and eval_file), "train_file and eval_file")
        if self.source == "files":
            for name, file in (("train", train_file), ("eval", eval_file)):
                path = require_file(str(file), self.data_dir)
                self._rows[name] = self._check(path, *read_table(path, format, header))

    def _check(self, path: Path | str, columns: list[str], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        text = column_name(columns, self.text_column, "text_column", Path(path))
        label = column_name(columns, self.label_column, "label_column", Path(path))
        seen = sorted({str(r.get(label)) for r in rows})
        unknown = [v for v in seen if v not in self.verbalizer]
        if unknown:
            raise KeyError(
                f"label(s) {unknown[:10]} in {path} are not in the verbalizer {self.verbalizer}; labels seen: {seen[:20]}"
            )
        return [{"text": str(r[text]), "label": self.labels.index(str(r[label]))} for r in rows]

    def verbalizer_ids(self, tokenizer: Any) -> list[list[int]]:
        """Token ids of each label's verbalizer word, in label order."""
        return [token_ids(tokenizer, " " + self.verbalizer[k]) for k in self.labels]

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Tokenize ``template(text) + " " + word``; long texts are cut to fit ``seq_len``."""
        if self.source == "hub":
            assert self.hub is not None
            for name in ("train", "eval"):
                rows = self._hub_rows(name)[1]
                self._rows[name] = self._check(f"hub:{self.hub['path']}", list(rows[0]) if rows else [], rows)
        words = self.verbalizer_ids(tokenizer)
        budget = seq_len - max(len(w) for w in words)

        def example(row: dict[str, Any]) -> Example:
            prompt = token_ids(tokenizer, self.template.format(text=row["text"]))[-budget:]
            word = words[row["label"]]
            return {"input_ids": prompt + word, "labels": [IGNORE] * len(prompt) + word, "prompt_ids": prompt,
                    "label": row["label"]}

        return self._tokenized(self._rows["train"], self._rows["eval"], example,
                               "the {name} file of the classification task holds no rows")
