"""Generic task types, configured from YAML: ``lm_text``, ``qa_jsonl`` and ``classification``.

A task is constructed (and its files and columns checked) before any model is loaded; ``build``
then tokenizes it into lists of examples. Each example is a dict with ``input_ids`` and ``labels``
(``-100`` on prompt and padding tokens); QA evaluation examples add ``prompt_ids`` and ``answer``,
classification ones ``prompt_ids`` and ``label``.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lcsb_lightning.recipes.batching import IGNORE, Example
from lcsb_lightning.recipes.data_io import (
    check_fields,
    column_name,
    iter_jsonl,
    load_hub_rows,
    read_table,
    read_text,
    require_file,
)

NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass
class TaskData:
    """Tokenized train and evaluation examples."""

    train: list[Example]
    eval: list[Example]
    skipped: int = 0
    info: dict[str, Any] = field(default_factory=dict)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _subsample(rows: list[Any], limit: int | None, seed: int | None) -> list[Any]:
    if limit is None or limit >= len(rows):
        return rows
    if seed is None:
        return rows[:limit]
    idx = sorted(random.Random(seed).sample(range(len(rows)), limit))
    return [rows[i] for i in idx]


class Task:
    """Base class of the task types.

    Args:
        max_train_examples: Use at most this many training examples (seeded subsample).
        max_eval_examples: Use the first this many evaluation examples.
        seed: Seed of the training subsample.
    """

    kind: ClassVar[str] = "lm"

    def __init__(self, max_train_examples: int | None = None, max_eval_examples: int | None = None, seed: int = 0):
        self.max_train_examples = max_train_examples
        self.max_eval_examples = max_eval_examples
        self.seed = seed

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Tokenize the task into training and evaluation examples of at most ``seq_len`` tokens."""
        raise NotImplementedError


class LMTextTask(Task):
    """Plain text language modelling: documents packed into fixed-length sequences (``lm_text``).

    Args:
        train_files: Text files to train on.
        eval_files: Text files to evaluate on; when empty, ``eval_fraction`` of the documents.
        builtin: ``"pydoc"`` for Python's own ``pydoc_data.topics`` text instead of files.
        eval_fraction: Share of documents held out when there are no ``eval_files``.
        split_lines: Treat each non-empty line as a document (else each file is one document).
        max_chars: Read at most this many characters per file (quick runs on large files).
        hub: ``{path, name, train_split, eval_split, text_field}`` to read from the Hugging Face hub.
        **kwargs: See :class:`Task`.
    """

    kind = "lm"

    def __init__(
        self,
        train_files: Sequence[str] = (),
        eval_files: Sequence[str] = (),
        builtin: str | None = None,
        eval_fraction: float = 0.1,
        split_lines: bool = False,
        max_chars: int | None = None,
        hub: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.builtin, self.hub = builtin, dict(hub) if hub else None
        self.eval_fraction, self.split_lines, self.max_chars = eval_fraction, split_lines, max_chars
        if builtin not in (None, "pydoc"):
            raise ValueError(f"unknown builtin text {builtin!r}; the only one is 'pydoc'")
        if not (0.0 < eval_fraction < 1.0):
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        if builtin is None and self.hub is None and not train_files:
            raise ValueError("lm_text needs train_files (a list of text files), builtin: pydoc, or hub:")
        self.train_files = [require_file(f) for f in train_files] if builtin is None and self.hub is None else []
        self.eval_files = [require_file(f) for f in eval_files] if builtin is None and self.hub is None else []

    def _documents(self) -> tuple[list[str], list[str]]:
        if self.builtin == "pydoc":
            from pydoc_data.topics import topics

            keys = sorted(topics)
            train = [topics[k] for i, k in enumerate(keys) if i % 10 != 0]
            return train, [topics[k] for i, k in enumerate(keys) if i % 10 == 0]
        if self.hub is not None:
            tf = self.hub.get("text_field", "text")
            train = [r[tf] for r in load_hub_rows(self.hub, self.hub.get("train_split", "train")) if r[tf].strip()]
            evals = [r[tf] for r in load_hub_rows(self.hub, self.hub.get("eval_split", "test")) if r[tf].strip()]
            return train, evals

        def docs(files: Iterable[Path]) -> list[str]:
            out: list[str] = []
            for f in files:
                text = read_text(f, self.max_chars)
                out.extend([ln for ln in text.splitlines() if ln.strip()] if self.split_lines else [text])
            return out

        train = docs(self.train_files)
        if self.eval_files:
            return train, docs(self.eval_files)
        if len(train) < 2:  # one big document: split its text
            text = train[0] if train else ""
            cut = int(len(text) * (1 - self.eval_fraction))
            return [text[:cut]], [text[cut:]]
        n_eval = max(1, int(len(train) * self.eval_fraction))
        return train[:-n_eval], train[-n_eval:]

    @staticmethod
    def _pack(tokenizer: Any, docs: list[str], seq_len: int, limit: int | None) -> list[Example]:
        eos = tokenizer.eos_token_id
        chunks: list[Example] = []
        buf: list[int] = []
        for doc in docs:
            buf.extend(_ids(tokenizer, doc))
            buf.append(eos)
            while len(buf) >= seq_len:
                ids, buf = buf[:seq_len], buf[seq_len:]
                chunks.append({"input_ids": ids, "labels": list(ids)})
                if limit is not None and len(chunks) >= limit:
                    return chunks
        return chunks

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Pack the training and evaluation documents into ``seq_len``-token sequences."""
        train_docs, eval_docs = self._documents()
        train = _subsample(self._pack(tokenizer, train_docs, seq_len, None), self.max_train_examples, self.seed)
        evals = self._pack(tokenizer, eval_docs, seq_len, self.max_eval_examples)
        for name, part in (("training", train), ("evaluation", evals)):
            if not part:
                raise ValueError(f"the {name} text is shorter than one sequence of seq_len={seq_len} tokens")
        return TaskData(train=train, eval=evals)


def extract_number(text: str, pattern: str | None) -> str | None:
    """Extract the final answer from ``text``: ``pattern``'s first group, else the last number.

    Args:
        text: A reference answer or a generated continuation.
        pattern: A regex with one group, e.g. ``"####\\s*(-?[\\d,\\.]+)"``.

    Returns:
        The normalised number (commas and a trailing dot removed), or None.
    """
    found: str | None = None
    if pattern:
        m = re.search(pattern, text)
        if m:
            found = m.group(1)
    if found is None:
        nums = NUMBER_RE.findall(text)
        found = nums[-1] if nums else None
    if found is None:
        return None
    found = found.replace(",", "").strip().rstrip(".")
    try:
        value = float(found)
    except ValueError:
        return found
    return str(int(value)) if value.is_integer() else str(value)


class QAJsonlTask(Task):
    """Question answering from JSON lines with prompt and answer fields (``qa_jsonl``).

    Training masks the prompt out of the loss; evaluation adds exact match of the final number of
    greedy generations on the first ``num_generate`` evaluation examples.

    Args:
        train_file: JSONL file to train on.
        eval_file: JSONL file to evaluate on.
        prompt_field: Field holding the question.
        answer_field: Field holding the answer.
        template: Prompt template with ``{prompt}``.
        answer_template: Target template with ``{answer}``.
        answer_regex: Regex whose first group is the final answer (else the last number is used).
        num_generate: How many evaluation examples get a greedy generation (0 disables exact match).
        max_new_tokens: Generation length.
        hub: ``{path, name, train_split, eval_split}`` to read from the Hugging Face hub.
        **kwargs: See :class:`Task`.
    """

    kind = "qa"

    def __init__(
        self,
        train_file: str | None = None,
        eval_file: str | None = None,
        prompt_field: str = "question",
        answer_field: str = "answer",
        template: str = "Question: {prompt}\nAnswer:",
        answer_template: str = " {answer}",
        answer_regex: str | None = r"####\s*(-?[\d,\.]+)",
        num_generate: int = 4,
        max_new_tokens: int = 128,
        hub: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.template, self.answer_template = template, answer_template
        self.answer_regex, self.num_generate, self.max_new_tokens = answer_regex, num_generate, max_new_tokens
        self.hub = dict(hub) if hub else None
        for tmpl, key in ((template, "prompt"), (answer_template, "answer")):
            names = {f for _, f, _, _ in string.Formatter().parse(tmpl) if f}
            if names != {key}:
                raise ValueError(f"template {tmpl!r} must use exactly the placeholder {{{key}}}, found {sorted(names)}")
        if answer_regex:
            re.compile(answer_regex)
        if self.hub is None:
            if not train_file or not eval_file:
                raise ValueError("qa_jsonl needs train_file and eval_file (or hub:)")
            self.train_file, self.eval_file = require_file(train_file), require_file(eval_file)
            for path in (self.train_file, self.eval_file):
                first = next(iter_jsonl(path), None)
                if first is None:
                    raise ValueError(f"{path} holds no rows")
                check_fields(first, [prompt_field, answer_field], path)

    def _rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        if self.hub is not None:
            return (
                load_hub_rows(self.hub, self.hub.get("train_split", "train")),
                load_hub_rows(self.hub, self.hub.get("eval_split", "test")),
            )
        return list(iter_jsonl(self.train_file)), list(iter_jsonl(self.eval_file))

    def _example(self, tokenizer: Any, row: Mapping[str, Any], seq_len: int) -> Example | None:
        prompt = _ids(tokenizer, self.template.format(prompt=row[self.prompt_field]))
        target = _ids(tokenizer, self.answer_template.format(answer=row[self.answer_field])) + [tokenizer.eos_token_id]
        if len(prompt) >= seq_len:
            return None
        ids = (prompt + target)[:seq_len]
        return {
            "input_ids": ids,
            "labels": ([IGNORE] * len(prompt) + target)[:seq_len],
            "prompt_ids": prompt,
            "answer": extract_number(str(row[self.answer_field]), self.answer_regex),
        }

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Tokenize prompts and answers; drop examples whose prompt alone fills ``seq_len``."""
        train_rows, eval_rows = self._rows()
        train_rows = _subsample(train_rows, self.max_train_examples, self.seed)
        eval_rows = _subsample(eval_rows, self.max_eval_examples, None)
        out: dict[str, list[Example]] = {"train": [], "eval": []}
        skipped = 0
        for name, rows in (("train", train_rows), ("eval", eval_rows)):
            for row in rows:
                ex = self._example(tokenizer, row, seq_len)
                if ex is None:
                    skipped += 1
                else:
                    out[name].append(ex)
            if not out[name]:
                raise ValueError(f"no {name} example fits seq_len={seq_len} ({skipped} prompts were too long)")
        return TaskData(train=out["train"], eval=out["eval"], skipped=skipped)


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
        hub: ``{path, name, train_split, eval_split}`` to read from the Hugging Face hub.
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
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if not verbalizer:
            raise ValueError("classification needs a verbalizer: {label value: word}")
        self.verbalizer = {str(k): str(v) for k, v in verbalizer.items()}
        self.labels = list(self.verbalizer)
        self.template, self.hub = template, dict(hub) if hub else None
        if "{text}" not in template:
            raise ValueError(f"template {template!r} must contain {{text}}")
        self.text_column, self.label_column = text_column, label_column
        self._rows_cache: dict[str, list[dict[str, Any]]] = {}
        if self.hub is None:
            if not train_file or not eval_file:
                raise ValueError("classification needs train_file and eval_file (or hub:)")
            for name, f in (("train", train_file), ("eval", eval_file)):
                path = require_file(f)
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
        return [_ids(tokenizer, " " + self.verbalizer[k]) for k in self.labels]

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Tokenize ``template(text) + " " + word``; long texts are cut to fit ``seq_len``."""
        if self.hub is not None:
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
            for row in _subsample(self._rows_cache[name], limit, seed):
                prompt = _ids(tokenizer, self.template.format(text=row["text"]))[-budget:]
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
