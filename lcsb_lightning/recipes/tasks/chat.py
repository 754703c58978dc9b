"""``chat``: conversations in the model's own chat template, the loss on the assistant turns only."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lcsb_lightning.recipes.batching import IGNORE
from lcsb_lightning.recipes.data_io import require_file
from lcsb_lightning.recipes.tasks.base import Example, Task, TaskData, check_fraction, token_ids

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
Message = dict[str, Any]


def check_conversation(row: Any, where: str) -> list[Message]:
    """The messages of one conversation ``row``, ``{"messages": [{"role": ..., "content": ...}, ...]}``; an
    assistant message with ``"weight": 0`` (the OpenAI fine-tuning format) stays out of the loss.

    Args:
        row: The parsed JSON line (or hub row).
        where: Where the row comes from, for the errors, e.g. ``"chats.jsonl line 3"``.

    Raises:
        ValueError: No ``messages`` list, a role outside system/user/assistant, a content that is not a string,
            a weight other than 0 or 1, or no assistant message to learn from; the message names ``where``.
    """
    messages = row.get("messages") if isinstance(row, Mapping) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}, "
                         f"got {json.dumps(row, default=str)[:120]}")
    for k, message in enumerate(messages, 1):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ROLES:
            raise ValueError(f"{where}, message {k}: role {role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}, message {k}: content must be a string, got {message.get('content')!r}")
        if message.get("weight", 1) not in (0, 1):
            raise ValueError(f"{where}, message {k}: weight must be 0 or 1, got {message['weight']!r}")
    if not any(m["role"] == "assistant" and m.get("weight", 1) for m in messages):
        raise ValueError(f"{where}: no assistant message to learn from (the loss is on the assistant turns only)")
    return [dict(m) for m in messages]


def read_conversations(path: Path) -> list[list[Message]]:
    """The conversations of a JSONL file, one per non-empty line; errors name the line."""
    conversations = []
    try:
        with path.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from exc
                conversations.append(check_conversation(row, f"{path} line {number}"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    if not conversations:
        raise ValueError(f"{path} holds no conversations")
    return conversations


def assistant_mask(tokenizer: Any, messages: list[Message], chat_template: str | None = None) -> Example:
    """The tokens of ``messages`` in the chat template, labelled on the assistant turns only.

    Each assistant message's tokens are those its rendering adds after the messages before it with the generation
    prompt, up to its end-of-turn token included (not the newline a template writes after that token).

    Example:
        >>> from transformers import ByT5Tokenizer
        >>> template = "{% for m in messages %}{{ m.role }}: {{ m.content }}</s>\\n{% endfor %}" \\
        ...            "{% if add_generation_prompt %}assistant: {% endif %}"
        >>> ex = assistant_mask(ByT5Tokenizer(), [{"role": "user", "content": "hi"},
        ...                     {"role": "assistant", "content": "hello"}], template)
        >>> ByT5Tokenizer().decode([t for t in ex["labels"] if t != -100])
        'hello</s>'

    Raises:
        ValueError: The template renders the first messages of a conversation otherwise than the start of the
            whole conversation (the mask cannot be read off it).
    """
    def render(part: list[Message], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(part, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    text = render(messages)
    ids = token_ids(tokenizer, text)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("weight", 1):
            continue
        begin, end = render(messages[:i], generation_prompt=True), render(messages[: i + 1]).rstrip()
        bounds = []
        for count, prefix in ((i, begin), (i + 1, end)):
            prefix_ids = token_ids(tokenizer, prefix)
            if not text.startswith(prefix) or ids[: len(prefix_ids)] != prefix_ids:
                raise ValueError(
                    f"the chat template renders the first {count} message(s) otherwise than the start of the whole "
                    f"conversation, so the tokens of assistant message {i + 1} cannot be told apart; first {count}: "
                    f"...{prefix[-60:]!r}, whole: ...{text[: len(prefix)][-60:]!r}")
            bounds.append(len(prefix_ids))
        labels[bounds[0] : bounds[1]] = ids[bounds[0] : bounds[1]]
    return {"input_ids": ids, "labels": labels}


class ChatTask(Task):
    """Conversations in the model's own chat template, the loss on the assistant turns only (``chat``).

    Each JSON line (or hub row) is ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}]}``
    (TRL, axolotl, the OpenAI fine-tuning API), rendered with the tokenizer's ``chat_template``. A conversation
    cut by ``seq_len`` before any assistant token is dropped.

    Args:
        path: JSONL file of conversations.
        eval_path: JSONL file to evaluate on; when null, the last ``eval_fraction`` of ``path``'s conversations.
        eval_fraction: Share of the conversations held out when there is no ``eval_path``.
        chat_template: A Jinja chat template, or a file holding one, instead of the tokenizer's (a model without
            one); null: the tokenizer's own.
        **kwargs: See :class:`Task` (``hub:`` rows hold ``messages``).
    """

    kind = "lm"

    def __init__(self, path: str | None = None, eval_path: str | None = None, eval_fraction: float = 0.1,
                 chat_template: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.eval_fraction = check_fraction(eval_fraction)
        if chat_template is not None and "{" not in chat_template:  # a file, not a template
            chat_template = require_file(chat_template, hint="give a Jinja template or a file holding one").read_text()
        self.chat_template = chat_template
        self.source = self._source(bool(path), "path= (a JSONL file of conversations)")
        if self.source == "files":
            train = read_conversations(require_file(str(path), self.data_dir))
            if eval_path:
                self._conversations = (train, read_conversations(require_file(eval_path, self.data_dir)))
            else:
                if len(train) < 2:
                    raise ValueError(f"{path} holds one conversation: give more, or eval_path=")
                held = max(1, int(len(train) * eval_fraction))
                self._conversations = (train[:-held], train[-held:])

    def _hub_conversations(self, name: str) -> list[list[Message]]:
        assert self.hub is not None
        split, rows = self._hub_rows(name)
        return [check_conversation(row, f"{self.hub['path']} {split} row {n}") for n, row in enumerate(rows, 1)]

    def build(self, tokenizer: Any, seq_len: int) -> TaskData:
        """Render and label the conversations, cut to ``seq_len`` tokens; drop those left with no assistant token."""
        if self.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the model's tokenizer ({type(tokenizer).__name__}) has no chat template; task=chat needs "
                             "a chat model (e.g. model=smollm2_135m), or task.chat_template=<a Jinja template or a file>")
        if self.source == "hub":
            self._conversations = (self._hub_conversations("train"), self._hub_conversations("eval"))

        def example(messages: list[Message]) -> Example | None:
            ex = assistant_mask(tokenizer, messages, self.chat_template)
            ex = {key: value[:seq_len] for key, value in ex.items()}
            return None if all(label == IGNORE for label in ex["labels"]) else ex

        data = self._tokenized(*self._conversations, example,
                               f"no {{name}} conversation has an assistant token within seq_len={seq_len}")
        if data.skipped:
            log.warning("chat: %d conversation(s) dropped: no assistant token within seq_len=%d", data.skipped, seq_len)
        return data
