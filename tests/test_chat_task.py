"""task=chat: JSONL conversations in the model's chat template (SmolLM2's, from its GGUF), the loss on the
assistant turns only; GSM8K's questions and answers as the conversations."""

from __future__ import annotations

import doctest
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from _recipes_utils import CHATML, FAST, SHARED_DATA, compose_cfg, one_thread  # noqa: F401
from hydra.utils import instantiate

from lcsb_lightning.recipes import models
from lcsb_lightning.recipes.tasks import ChatTask, chat
from lcsb_lightning.recipes.train import prepare, run_finetune

GSM8K = SHARED_DATA / "gsm8k" / "train.jsonl"


def gsm8k_rows(count: int) -> list[dict[str, str]]:
    """GSM8K's first ``count`` training rows (``question``, ``answer``)."""
    if not GSM8K.is_file():
        pytest.skip(f"GSM8K is not at {GSM8K}")
    with GSM8K.open() as fh:
        return [json.loads(next(fh)) for _ in range(count)]


def as_conversation(row: dict[str, str]) -> dict[str, Any]:
    """A GSM8K row as a chat: the question from the user, the worked answer from the assistant."""
    return {"messages": [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def labelled_text(tokenizer: Any, example: dict[str, list[int]]) -> str:
    return tokenizer.decode([t for t in example["labels"] if t != -100])


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SmolLM2-135M-Instruct's tokenizer as the recipes cache it from the GGUF (saved and read back; ~6 s)."""
    from transformers import AutoTokenizer

    try:
        gguf = models.smollm2_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    files = tmp_path_factory.mktemp("smollm2")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(files)
    return AutoTokenizer.from_pretrained(str(files))


@pytest.mark.slow  # GGUFReader parses the whole vocabulary again (~6 s)
def test_the_gguf_tokenizer_carries_the_files_chat_template(smollm2_tokenizer: Any) -> None:
    from gguf import GGUFReader

    field = GGUFReader(str(models.smollm2_gguf_path())).fields["tokenizer.chat_template"]
    assert smollm2_tokenizer.chat_template == bytes(field.parts[field.data[0]]).decode()


def test_the_loss_is_on_each_gsm8k_answer_and_its_end_of_turn_token(smollm2_tokenizer: Any) -> None:
    for row in gsm8k_rows(4):
        messages = as_conversation(row)["messages"]
        example = chat.assistant_mask(smollm2_tokenizer, messages)
        assert example["input_ids"] == smollm2_tokenizer.apply_chat_template(messages, return_dict=True)["input_ids"]
        assert labelled_text(smollm2_tokenizer, example) == row["answer"] + "<|im_end|>"
        labelled = [i for i, t in enumerate(example["labels"]) if t != -100]
        assert labelled == list(range(labelled[0], labelled[-1] + 1))  # one span, ending on <|im_end|>
        assert example["input_ids"][labelled[-1]] == smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_several_assistant_turns_are_labelled_and_nothing_else(smollm2_tokenizer: Any) -> None:
    first, second = gsm8k_rows(2)
    messages = [{"role": "system", "content": "Show your work."},
                *as_conversation(first)["messages"], *as_conversation(second)["messages"]]
    example = chat.assistant_mask(smollm2_tokenizer, messages)
    assert labelled_text(smollm2_tokenizer, example) == first["answer"] + "<|im_end|>" + second["answer"] + "<|im_end|>"
    messages[2]["weight"] = 0  # OpenAI's format: this answer is context, not a target
    example = chat.assistant_mask(smollm2_tokenizer, messages)
    assert labelled_text(smollm2_tokenizer, example) == second["answer"] + "<|im_end|>"


def test_the_task_cuts_to_seq_len_and_drops_conversations_left_without_an_answer_token(
        smollm2_tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = [as_conversation(r) for r in gsm8k_rows(12)]
    answer_lengths = [len(smollm2_tokenizer(r["messages"][1]["content"])["input_ids"]) + 2 for r in rows]  # <|im_end|>\n
    prompt_lengths = [len(chat.assistant_mask(smollm2_tokenizer, r["messages"])["labels"]) - n
                      for r, n in zip(rows, answer_lengths)]
    order = sorted(range(12), key=prompt_lengths.__getitem__)
    seq_len = prompt_lengths[order[7]] + 1  # the four longest prompts fill it (or more, on ties)
    expected_dropped = sum(length >= seq_len for length in prompt_lengths)
    train = write_jsonl(tmp_path / "train.jsonl", [rows[i] for i in order[2:]])
    evals = write_jsonl(tmp_path / "eval.jsonl", [rows[i] for i in order[:2]])
    task = ChatTask(path=str(train), eval_path=str(evals))
    with caplog.at_level(logging.WARNING, logger=chat.__name__):
        data = task.build(smollm2_tokenizer, seq_len)
    assert data.skipped == expected_dropped >= 4 and len(data.eval) == 2
    assert len(data.train) == 10 - expected_dropped
    assert f"{expected_dropped} conversation(s) dropped: no assistant token within seq_len={seq_len}" in caplog.text
    for example in data.train + data.eval:
        assert len(example["input_ids"]) == len(example["labels"]) <= seq_len
        assert any(t != -100 for t in example["labels"])


BAD_LINES = [
    ({"question": "q", "answer": "a"}, r"line 2: expected \{\"messages\""),
    ({"messages": []}, r"line 2: expected"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
     r"line 2, message 2: role 'bot' is not one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": "q"}]}, r"line 2: no assistant message to learn from"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]},
     r"line 2: no assistant message to learn from"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ["a"]}]},
     r"line 2, message 2: content must be a string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 2}]},
     r"line 2, message 2: weight must be 0 or 1"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_LINES)
def test_a_bad_line_is_refused_with_its_line_number(tmp_path: Path, bad: dict[str, Any], message: str) -> None:
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "chats.jsonl", [good, bad, good])
    with pytest.raises(ValueError, match=f"chats.jsonl {message}"):
        ChatTask(path=str(path))


def test_a_line_that_is_not_json_is_refused_with_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "assistant", "content": "a"}]}\n\n{"messages": [\n')
    with pytest.raises(ValueError, match="chats.jsonl line 3: not JSON"):
        ChatTask(path=str(path))


def test_a_template_that_renders_a_prefix_otherwise_is_refused(tmp_path: Path) -> None:
    from transformers import ByT5Tokenizer

    last_differs = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.content }}</s>{% endfor %}"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError, match="renders the first 1 message.* otherwise than the start of the whole conversation"):
        chat.assistant_mask(ByT5Tokenizer(), messages, last_differs)


def test_a_model_without_a_chat_template_is_refused_before_training(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", [as_conversation(r) for r in gsm8k_rows(4)])
    with pytest.raises(ValueError, match=r"tokenizer \(ByT5Tokenizer\) has no chat template; task=chat needs a chat model"):
        prepare(compose_cfg([*FAST, "task=chat", f"task.path={path}"]))


def test_hub_rows_are_read_and_checked(tmp_path: Path) -> None:
    """``hub.path`` may be a local folder laid out as a hub data set (here: its ``train`` and ``test`` files)."""
    from transformers import ByT5Tokenizer

    folder = tmp_path / "chats"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [as_conversation(r) for r in gsm8k_rows(3)])
    write_jsonl(folder / "test.jsonl", [as_conversation(gsm8k_rows(4)[3]), {"messages": [{"role": "user", "content": "q"}]}])
    task = ChatTask(hub={"path": str(folder)}, chat_template=CHATML)
    with pytest.raises(ValueError, match=r"chats test row 2: no assistant message"):
        task.build(ByT5Tokenizer(), 512)


def test_the_docstring_example_runs() -> None:
    result = doctest.testmod(chat, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


def test_a_tiny_model_run_on_gsm8k_conversations(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gsm8k_chat.jsonl", [as_conversation(r) for r in gsm8k_rows(12)])
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    cfg = compose_cfg([*FAST, "task=chat", f"task.path={path}", f"task.chat_template={template}", "task.eval_fraction=0.25",
                       "seq_len=384", "module.lr=1e-2"])
    assert isinstance(instantiate(cfg.task, _convert_="all"), ChatTask)
    summary = run_finetune(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    assert summary["task"] == "ChatTask" and summary["steps"] == 4
    assert summary["final_metrics"]["val/loss"] < summary["initial_metrics"]["val/loss"]
