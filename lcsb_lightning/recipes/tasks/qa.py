"""``qa_jsonl``: question answering from JSON lines; the loss on the answer, exact match of the final number."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

from lcsb_lightning.recipes.batching import IGNORE
from lcsb_lightning.recipes.data_io import check_fields, read_table, require_file
from lcsb_lightning.recipes.tasks.base import Example, Task, TaskData, extract_number, token_ids


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
        **kwargs: See :class:`Task`.
    """

    kind = "qa"

    def __init__(self, train_file: str | None = None, eval_file: str | None = None, prompt_field: str = "question",
                 answer_field: str = "answer", template: str = "Question: {prompt}\nAnswer:",
                 answer_template: str = " {answer}", answer_regex: str | None = r"####\s*(-?[\d,\.]+)",
                 num_generate: int = 4, max_new_tokens: int = 128, **kwargs: Any):
        super().__init__(**kwargs)
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.template, self.answer_template = template, answer_template
        self.answer_regex, self.num_generate, self.max_new_tokens = answer_regex, num_generate, max_new_tokens
        if num_generate < 0 or max_new_tokens < 1:
            raise ValueError(f"num_generate must be >= 0 and max_new_tokens >= 1, got {num_generate} and {max_new_tokens}")
        for tmpl, key in ((template, "prompt"), (answer_template, "answer")):
            names = {f for _, f, _, _ in string.Formatter().parse(tmpl) if f}
            if names != {key}:
                raise ValueError(f"template {tmpl!r} must use exactly the placeholder {{{key}}}, found {sorted(names)}")
        if answer_regex:
            re.compile(answer_regex)
        self.source = self._source(bool(train_file and eval_file), "train_file and eval_file")
        self._rows: dict[str, list[dict[str, Any]]] = {}
        if self.source == "files":
            for name, file in (("train", train_file), ("eval", eval_file)):
                path = require_file(str(file), self.data_dir)
                columns, self._rows[name] = read_table(path, "jsonl")
                check_fields(columns, [prompt_field, answer_field], path)

    def _example(self, tokenizer: Any, row: Mapping[str, Any], seq_len: int) -> Example | None:
        prompt = token_ids(tokenizer, self.template.format(prompt=row[self.prompt_field]))
        target = token_ids(tokenizer, self.answer_template.format(answer=row[self.answer_field])) + [tokenizer.eos_token_id]
        if len(prompt) >= seq_len:
            return None
        return {
            "input_ids": (prompt + target)[:seq_len],
            "labels": ([IGNORE] * len(prompt) + target)[:seq_len],
            "prompt_ids": prompt,
            "answer": extract_number(str(row[self.answer_field]), self.answer_regex),
        }

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Tokenize prompts and answers; drop examples whose prompt alone fills ``seq_len``."""
        if self.source == "hub":
            self._rows = {name: self._hub_rows(name)[1] for name in ("train", "eval")}
        return self._tokenized(self._rows["train"], self._rows["eval"],
                               lambda row: self._example(tokenizer, row, seq_len),
                               f"no {{name}} example fits seq_len={seq_len} ({{skipped}} prompts were too long)")
