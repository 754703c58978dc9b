"""The recipe's default guard (``guard=skip``) on a healthy run of every task preset (model=tiny): nothing
is skipped, past the guard's warmup."""

from __future__ import annotations

from pathlib import Path

import pytest

from _recipes_utils import FAST, SHARED_DATA, compose_cfg, one_thread, write_chat, write_cls, write_qa, write_text  # noqa: F401
from lcsb_lightning.recipes.train import run_finetune

CONF_TASKS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "task").glob("*.yaml"))
STEPS = 40  # the recipe's guard looks for spikes after 20 good steps
SHARED = {  # the presets that read ../shared/data (data_dir=)
    "gsm8k": ["task.max_train_examples=64", "task.max_eval_examples=2", "task.num_generate=1", "task.max_new_tokens=2",
              "seq_len=512"],
    "sst2": ["task.max_train_examples=200", "task.max_eval_examples=8", "seq_len=64"],
    "wikitext2": ["task.train_files=[wikitext-2/valid.txt]", "task.max_chars=40000", "task.max_eval_examples=2"],
}


def _task_overrides(name: str, tmp_path: Path) -> list[str]:
    if name in SHARED:
        if not SHARED_DATA.is_dir():
            pytest.skip(f"{SHARED_DATA} is not here")
        return [f"task={name}", f"data_dir={SHARED_DATA}", *SHARED[name]]
    if name == "classification":
        train, evals = write_cls(tmp_path)
        return ["task=classification", f"task.train_file={train}", f"task.eval_file={evals}", "task.text_column=sentence",
                "task.verbalizer={0: bad, 1: good}"]
    if name in ("lm_text", "pydoc"):
        train, evals = write_text(tmp_path)
        files = [f"task.train_files=[{train}]", f"task.eval_files=[{evals}]"] if name == "lm_text" else []
        return [f"task={name}", *files, "task.max_eval_examples=2"]
    if name == "qa_jsonl":
        train, evals = write_qa(tmp_path)
        return ["task=qa_jsonl", f"task.train_file={train}", f"task.eval_file={evals}", "task.num_generate=1", "seq_len=64",
                "task.max_new_tokens=2"]
    if name == "chat":
        chats, template = write_chat(tmp_path)
        return ["task=chat", f"task.path={chats}", f"task.chat_template={template}", "seq_len=64"]
    raise AssertionError(f"conf/task/{name}.yaml has no case here: add one")


@pytest.mark.parametrize("name", CONF_TASKS)
def test_a_healthy_run_of_every_task_preset_skips_nothing(name: str, tmp_path: Path) -> None:
    overrides = [*FAST, *_task_overrides(name, tmp_path), f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}",
                 "eval_before_training=false", "guard=skip"]
    summary = run_finetune(compose_cfg(overrides), tmp_path / "run")
    assert summary["steps"] == STEPS
    assert summary["divergence_events"] == []
