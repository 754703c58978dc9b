"""What every task type shares: the tokenized data, subsampling, and where the data comes from."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lcsb_lightning.recipes.batching import Example
from lcsb_lightning.recipes.data_io import check_hub, load_hub_rows
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


def check_fraction(eval_fraction: float) -> float:
    """``eval_fraction``, or a ValueError where it is not in (0, 1)."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    return eval_fraction


class Task:
    """Base class of the task types: data from local files, or from the Hugging Face hub (``hub:``, through
    ``datasets.load_dataset``); a preset names both, and reads its files when ``data_dir`` is given.

    Args:
        max_train_examples: Use at most this many training examples (seeded subsample).
        max_eval_examples: Use the first this many evaluation examples.
        seed: Seed of the training subsample.
        hub: ``{path, name, train_split, eval_split}`` for ``datasets.load_dataset``.
        data_dir: Read the task's files relative to this folder instead of the hub.
    """

    kind: ClassVar[str] = "lm"
    #: The hub split evaluated on when ``hub:`` names no ``eval_split``.
    eval_split: ClassVar[str] = "test"

    def __init__(self, max_train_examples: int | None = None, max_eval_examples: int | None = None, seed: int = 0,
                 hub: Mapping[str, Any] | None = None, data_dir: str | None = None):
        self.max_train_examples, self.max_eval_examples = (
            None if value is None else check_int(name, value, 1)
            for name, value in (("max_train_examples", max_train_examples), ("max_eval_examples", max_eval_examples)))
        self.seed, self.data_dir = seed, data_dir
        self.hub = check_hub(hub) if hub else None

    def _source(self, has_files: bool, needs: str) -> str:
        """``"hub"`` when the task names a hub data set and no ``data_dir``, else ``"files"``: a ValueError saying
        what the task ``needs`` where it names none."""
        if self.data_dir is None and self.hub:
            return "hub"
        if not has_files:
            raise ValueError(f"{type(self).__name__} needs {needs} (or hub:, a data set of the Hugging Face hub)")
        return "files"

    def _hub_rows(self, name: str) -> tuple[str, list[dict[str, Any]]]:
        """The split that ``hub:`` names for ``name`` (``train`` or ``eval``) and its rows."""
        assert self.hub is not None
        split = self.hub.get(f"{name}_split", "train" if name == "train" else self.eval_split)
        return split, load_hub_rows(self.hub, split)

    def _tokenized(self, train: list[Any], evals: list[Any], example: Callable[[Any], Example | None],
                   empty: str) -> TaskData:
        """The examples that ``example`` makes of the rows (None: skipped), each part cut to its limit (a seeded
        sample of ``train``); a ValueError ``empty`` (formatted with ``name`` and ``skipped``) where a part has none."""
        out: dict[str, list[Example]] = {}
        skipped = 0
        for name, rows in (("train", subsample(train, self.max_train_examples, self.seed)),
                           ("eval", subsample(evals, self.max_eval_examples, None))):
            made = [example(row) for row in rows]
            out[name] = [ex for ex in made if ex is not None]
            skipped += len(made) - len(out[name])
            if not out[name]:
                raise ValueError(empty.format(name=name, skipped=skipped))
        return TaskData(train=out["train"], eval=out["eval"], skipped=skipped)

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Tokenize the task into training and evaluation examples of at most ``seq_len`` tokens."""
        raise NotImplementedError


def extract_number(text: str, pattern: str | None) -> str | None:
    """The final answer in ``text``: ``pattern``'s first group, else the last number; normalised (commas and a
    trailing dot removed, ``"12.0"`` -> ``"12"``), or None."""
    match = re.search(pattern, text) if pattern else None
    found: str | None = match.group(1) if match else None
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
