"""``classification``: texts scored by the log-likelihood of one verbalizer word per label."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lcsb_lightning.recipes.batching import IGNORE
from lcsb_lightning.recipes.data_io import check_hub, column_name, load_hub_rows, read_table, require_file
from lcsb_lightning.recipes.tasks.base import Example, Task, TaskData, data_source, subsample, token_ids


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
        hub: ``{path, name, train_split, eval_split}`` for ``datasets.load_dataset``.
        data_dir: Read ``train_file``/``eval_file`` relative to this folder instead of the hub.
        **kwargs: See :class:`Task`.
    """

    kind = "classification"

    def __init__(
        self,
        train_file: str | None = None,
        eval_file: str | None = None,
        text_column: str | int = "sentence",
        label_column: str | int = "label",
        verbalizer: Mapping[Any, str] | None = None,
        template: str = "{text}\nSentiment:",
        format: str = "auto",  # noqa: A002 - the YAML key users write
        header: bool = True,
        hub: Mapping[str, Any] | None = None,
        data_dir: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if not verbalizer:
            raise ValueError("classification needs a verbalizer: {label value: word}")
        self.verbalizer = {str(k): str(v) for k, v in verbalizer.items()}
        self.labels = list(self.verbalizer)
        self.template, self.hub = template, check_hub(hub) if hub else None
        if "{text}" not in template:
            raise ValueError(f"template {template!r} must contain {{text}}")
        self.text_column, self.label_column = text_column, label_column
        self._rows_cache: dict[str, list[dict[str, Any]]] = {}
        self.source = data_source(data_dir, self.hub, bool(train_file or eval_file))
        if self.source == "files":
            if not train_file or not eval_file:
                raise ValueError("classification needs train_file and eval_file (or hub:)")
            paths = {"train": require_file(train_file, data_dir), "eval": require_file(eval_file, data_dir)}
            for name, path in paths.items():
                columns, rows = read_table(path, format, header)
                self._rows_cache[name] = self._check(path, columns, rows)

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
                rows = load_hub_rows(self.hub, self.hub.get(f"{name}_split", name))
                cols = list(rows[0].keys()) if rows else []
                self._rows_cache[name] = self._check(f"hub:{self.hub['path']}", cols, rows)
        words = self.verbalizer_ids(tokenizer)
        budget = seq_len - max(len(w) for w in words)
        out: dict[str, list[Example]] = {}
        for name, limit, seed in (
            ("train", self.max_train_examples, self.seed),
            ("eval", self.max_eval_examples, None),
        ):
            examples = []
            for row in subsample(self._rows_cache[name], limit, seed):
                prompt = token_ids(tokenizer, self.template.format(text=row["text"]))[-budget:]
                word = words[row["label"]]
                examples.append(
                    {
                        "input_ids": prompt + word,
                        "labels": [IGNORE] * len(prompt) + word,
                        "prompt_ids": prompt,
                        "label": row["label"],
                    }
                )
            if not examples:
                raise ValueError(f"the {name} file of the classification task holds no rows")
            out[name] = examples
        return TaskData(train=out["train"], eval=out["eval"])
