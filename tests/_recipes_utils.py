"""Helpers of the recipe tests: compose ``conf/`` with overrides and write small task files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from lcsb_lightning.recipes.cli import CONFIG_MODULE

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
#: The console script, as a subprocess runs it.
FINETUNE = shutil.which("lcsb-finetune") or str(Path(sys.executable).parent / "lcsb-finetune")


def finetune_env() -> dict[str, str]:
    """The environment of a console-script run: one thread (two may run side by side), no hub."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_finetune_cli(run_dir: Path, *overrides: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``lcsb-finetune OVERRIDES hydra.run.dir=RUN_DIR`` to completion, output captured."""
    return subprocess.run([FINETUNE, *overrides, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=finetune_env(),
                          capture_output=True, text=True, timeout=timeout)


def checkpoint_step(path: Path) -> int:
    """The global step of the checkpoint at ``path``; 0 while there is none (or it is being replaced)."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])
    except Exception:  # noqa: BLE001 - not there yet, or being replaced
        return 0

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
    "lcsb.log_every_n_steps=2",
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


@contextmanager
def finetune_composer() -> Iterator[Callable[[object], DictConfig]]:
    """One thread and the packaged configs: yields what a benchmark study composes its runs' configs with."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            yield lambda overrides: compose(config_name="config", overrides=list(overrides))
    finally:
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


#: ChatML for the tiny model's byte tokenizer, which has no chat template; ``</s>`` ends a turn.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_chat(tmp: Path) -> tuple[Path, Path]:
    """Small conversations (``{"messages": [user, assistant]}``) and a ChatML template file for the tiny model."""
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
            for a in range(6) for b in range(4)]
    path, template = tmp / "chats.jsonl", tmp / "chatml.jinja"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template.write_text(CHATML)
    return path, template


def write_cls(tmp: Path) -> tuple[Path, Path]:
    """Small SST-2-style TSV files with a header ``sentence<TAB>label``."""
    good = ["a great film", "truly lovely", "warm and funny", "a joy to watch"]
    bad = ["a dull mess", "boring and long", "painfully bad", "a waste of time"]
    lines = [f"{s}\t1" for s in good] + [f"{s}\t0" for s in bad]
    train, evals = tmp / "train.tsv", tmp / "dev.tsv"
    train.write_text("sentence\tlabel\n" + "\n".join(lines * 2) + "\n")
    evals.write_text("sentence\tlabel\n" + "\n".join(lines) + "\n")
    return train, evals
