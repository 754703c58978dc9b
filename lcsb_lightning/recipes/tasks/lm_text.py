"""``lm_text``: plain text packed into fixed-length sequences (files, a hub data set, or Python's own docs)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lcsb_lightning.recipes.data_io import read_text, require_file
from lcsb_lightning.recipes.tasks.base import Example, Task, TaskData, check_fraction, subsample, token_ids


class LMTextTask(Task):
    """Plain text language modelling: documents packed into fixed-length sequences (``lm_text``).

    Args:
        train_files: Text files to train on.
        eval_files: Text files to evaluate on; when empty, ``eval_fraction`` of the documents.
        builtin: ``"pydoc"`` for Python's own ``pydoc_data.topics`` text instead of files.
        eval_fraction: Share of documents held out when there are no ``eval_files``.
        split_lines: Treat each non-empty line as a document (else each file, or each hub split, is one
            document: hub rows are its lines).
        max_chars: Read at most this many characters per file (quick runs on large files).
        **kwargs: See :class:`Task`; ``hub:`` also takes ``text_field`` (default ``text``).
    """

    kind = "lm"

    def __init__(self, train_files: Sequence[str] = (), eval_files: Sequence[str] = (), builtin: str | None = None,
                 eval_fraction: float = 0.1, split_lines: bool = False, max_chars: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if builtin not in (None, "pydoc"):
            raise ValueError(f"unknown builtin text {builtin!r}; the only one is 'pydoc'")
        self.builtin, self.eval_fraction = builtin, check_fraction(eval_fraction)
        self.split_lines, self.max_chars = split_lines, max_chars
        needs = "train_files (text files) or builtin: pydoc"
        self.source = "builtin" if builtin else self._source(bool(train_files), needs)
        files = self.source == "files"
        self.train_files = [require_file(f, self.data_dir) for f in train_files] if files else []
        self.eval_files = [require_file(f, self.data_dir) for f in eval_files] if files else []

    def _documents(self) -> tuple[list[str], list[str]]:
        if self.builtin == "pydoc":
            from pydoc_data.topics import topics

            keys = sorted(topics)
            train = [topics[k] for i, k in enumerate(keys) if i % 10 != 0]
            return train, [topics[k] for i, k in enumerate(keys) if i % 10 == 0]
        if self.source == "hub":
            return self._hub_documents("train"), self._hub_documents("eval")

        def docs(files: list[Path]) -> list[str]:
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

    def _hub_documents(self, name: str) -> list[str]:
        """A hub split's rows are the lines of its text: one document, or one per line with ``split_lines``."""
        assert self.hub is not None
        field = self.hub.get("text_field", "text")
        _, rows = self._hub_rows(name)
        if rows and field not in rows[0]:
            raise KeyError(f"text_field={field!r} not in {self.hub['path']!r}; fields seen: {list(rows[0])}")
        lines = [str(r[field]).rstrip("\n") for r in rows]
        if self.split_lines:
            return [line for line in lines if line.strip()]
        text = "\n".join(lines)
        return [text[: self.max_chars] if self.max_chars else text]

    @staticmethod
    def _pack(tokenizer: Any, docs: list[str], seq_len: int, limit: int | None) -> list[Example]:
        chunks: list[Example] = []
        buf: list[int] = []
        for doc in docs:
            buf += [*token_ids(tokenizer, doc), tokenizer.eos_token_id]
            while len(buf) >= seq_len:
                ids, buf = buf[:seq_len], buf[seq_len:]
                chunks.append({"input_ids": ids, "labels": list(ids)})
                if limit is not None and len(chunks) >= limit:
                    return chunks
        return chunks

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Pack the training and evaluation documents into ``seq_len``-token sequences."""
        train_docs, eval_docs = self._documents()
        train = subsample(self._pack(tokenizer, train_docs, seq_len, None), self.max_train_examples, self.seed)
        evals = self._pack(tokenizer, eval_docs, seq_len, self.max_eval_examples)
        for name, part in (("training", train), ("evaluation", evals)):
            if not part:
                raise ValueError(f"the {name} text is shorter than one sequence of seq_len={seq_len} tokens")
        return TaskData(train=train, eval=evals)
