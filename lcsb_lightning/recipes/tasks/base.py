"""What every task type shares: the tokenized data, subsampling, and where the data comes from."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lcsb_lightning.recipes.batching import Example
from lcsb_lightning.validation import check_int

NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass
class TaskData:
    """Tokenized train and evaluation examples."""

    train: list[Example]
    eval: list[Example]
    skipped: int = 0
    info: dict[str, Any] = field(default_factory=dict)


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def subsample(rows: list[Any], limit: int | None, seed: int | None) -> list[Any]:
    """At most ``limit`` of ``rows`` in their order: a seeded sample, or the first ones with ``seed=None``."""
    if limit is None or limit >= len(rows):
        return rows
    if seed is None:
        return rows[:limit]
    idx = sorted(random.Random(seed).sample(range(len(rows)), limit))
    return [rows[i] for i in idx]


def data_source(data_dir: str | None, hub: Mapping[str, Any] | None, has_files: bool) -> str:
    """Where a task reads its data: ``"files"`` under ``data_dir`` when one is given, else ``"hub"``
    when the task names a hub data set, else ``"files"`` as configured."""
    if data_dir is not None:
        return "files"
    if hub:
        return "hub"
    if has_files:
        return "files"
    raise ValueError("the task names neither files (or data_dir=) nor a hub data set (hub:)")


class Task:
    """Base class of the task types.

    Every task reads its data either from the Hugging Face hub (``hub:``, through
    ``datasets.load_dataset``) or from local files; a preset names both, and reads its files
    (relative to ``data_dir``) when ``data_dir`` is given.

    Args:
        max_train_examples: Use at most this many training examples (seeded subsample).
        max_eval_examples: Use the first this many evaluation examples.
        seed: Seed of the training subsample.
    """

    kind: ClassVar[str] = "lm"

    def __init__(self, max_train_examples: int | None = None, max_eval_examples: int | None = None, seed: int = 0):
        self.max_train_examples, self.max_eval_examples = (
            None if value is None else check_int(name, value, 1)
            for name, value in (("max_train_examples", max_train_examples), ("max_eval_examples", max_eval_examples)))
        self.seed = seed

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Tokenize the task into training and evaluation examples of at most ``seq_len`` tokens."""
        raise NotImplementedError


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
