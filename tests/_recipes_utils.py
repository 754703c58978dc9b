"""Helpers of the recipe tests: compose ``conf/`` with overrides and write small task files."""

from __future__ import annotations

import json
from pathlib import Path

from collections.abc import Iterator

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from lcsb_lightning.recipes.cli import CONFIG_MODULE

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Short, fast settings for the tiny model (seconds per run on 2 cores).
FAST = [
    "model=tiny",
    "seq_len=32",
    "batch_size=2",
    "eval_batch_size=4",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "policy.log_every_n_steps=2",
]

TEXT = (
    "The quick brown fox jumps over the lazy dog. Lightning trains models; LoRA adapts them.\n"
    "Layer-cyclic selective backpropagation trains a few blocks per step and skips the rest.\n"
) * 12


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny model's kernels are too small for threads; one thread avoids spin-wait stalls on busy CPUs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def compose_cfg(overrides: list[str]) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra's compose API."""
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def write_text(tmp: Path) -> tuple[Path, Path]:
    """Two small text files (train, eval)."""
    train, evals = tmp / "train.txt", tmp / "eval.txt"
    train.write_text(TEXT)
    evals.write_text(TEXT[::-1][:600])
    return train, evals


def write_qa(tmp: Path) -> tuple[Path, Path]:
    """Small GSM8K-style JSONL files (question, answer with ``#### n``)."""
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(6) for b in range(4)]
    train, evals = tmp / "qa_train.jsonl", tmp / "qa_test.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:18]))
    evals.write_text("".join(json.dumps(r) + "\n" for r in rows[18:]))
    return train, evals


def write_cls(tmp: Path) -> tuple[Path, Path]:
    """Small SST-2-style TSV files with a header ``sentence<TAB>label``."""
    good = ["a great film", "truly lovely", "warm and funny", "a joy to watch"]
    bad = ["a dull mess", "boring and long", "painfully bad", "a waste of time"]
    lines = [f"{s}\t1" for s in good] + [f"{s}\t0" for s in bad]
    train, evals = tmp / "train.tsv", tmp / "dev.tsv"
    train.write_text("sentence\tlabel\n" + "\n".join(lines * 2) + "\n")
    evals.write_text("sentence\tlabel\n" + "\n".join(lines) + "\n")
    return train, evals
