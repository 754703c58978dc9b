"""``qa_jsonl``: question answering from JSON lines; the loss on the answer, exact match of the final number."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

from lcsb_lightning.recipes.batching import IGNORE
from lcsb_lightning.recipes.data_io import check_fields, check_hub, load_hub_rows, read_table, require_file
from lcsb_lightning.recipes.tasks.base import Example, Task, TaskData, data_source, extract_number, subsample, token_ids


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
        hub: ``{path, name, train_split, eval_split}`` for ``datasets.load_dataset``.
        data_dir: Read ``train_file``/``eval_file`` relative to this folder instead of the hub.
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
        data_dir: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.template, self.answer_template = template, answer_template
        self.answer_regex, self.num_generate, self.max_new_tokens = answer_regex, num_generate, max_new_tokens
        self.hub = check_hub(hub) if hub else None
        if num_generate < 0 or max_new_tokens < 1:
            raise ValueError(f"num_generate must be >= 0 and max_new_tokens >= 1, got {num_generate} and {max_new_tokens}")
        for tmpl, key in ((template, "prompt"), (answer_template, "answer")):
            names = {f for _, f, _, _ in string.Formatter().parse(tmpl) if f}
            if names != {key}:
                raise ValueError(f"template {tmpl!r} must use exactly the placeholder {{{key}}}, found {sorted(names)}")
        if answer_regex:
            re.compile(answer_regex)
        self.source = data_source(data_dir, self.hub, bool(train_file or eval_file))
        if self.source == "files":
            if not train_file or not eval_file:
                raise ValueError("qa_jsonl needs train_file and eval_file (or hub:)")
            self._file_rows: list[list[dict[str, Any]]] = []
            for path in [require_file(train_file, data_dir), require_file(eval_file, data_dir)]:
                columns, rows = read_table(path, "jsonl")
                check_fields(columns, [prompt_field, answer_field], path)
                self._file_rows.append(rows)

    def _rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        if self.source == "hub":
            assert self.hub is not None
            return (
                load_hub_rows(self.hub, self.hub.get("train_split", "train")),
                load_hub_rows(self.hub, self.hub.get("eval_split", "test")),
            )
        return self._file_rows[0], self._file_rows[1]

    def _example(self, tokenizer: Any, row: Mapping[str, Any], seq_len: int) -> Example | None:
        prompt = token_ids(tokenizer, self.template.format(prompt=row[self.prompt_field]))
        target = token_ids(tokenizer, self.answer_template.format(answer=row[self.answer_field])) + [tokenizer.eos_token_id]
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
        train_rows = subsample(train_rows, self.max_train_examples, self.seed)
        eval_rows = subsample(eval_rows, self.max_eval_examples, None)
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
