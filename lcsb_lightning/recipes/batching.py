"""Batching of tokenized task examples: right padding, attention masks, ``-100`` labels."""

from __future__ import annotations

from typing import Any

IGNORE = -100
Example = dict[str, Any]
#: The keys of an example that are padded into tensors; the others are batched as lists.
PADDED = ("input_ids", "labels")


class PaddingCollator:
    """Pads ``input_ids`` (pad id) and ``labels`` (``-100``) to the longest example, on the tokenizer's
    ``padding_side``, with an ``attention_mask`` (``transformers.DataCollatorForSeq2Seq``); the other keys of the
    examples (``prompt_ids``, ``answer``, ``label``) are kept as lists.

    Args:
        tokenizer: The tokenizer whose pad token id pads ``input_ids``.
    """

    def __init__(self, tokenizer: Any) -> None:
        from transformers import DataCollatorForSeq2Seq

        self.collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE, return_tensors="pt")

    def __call__(self, batch: list[Example]) -> dict[str, Any]:
        """The batch of ``batch``'s examples (from :meth:`Task.build`)."""
        out = dict(self.collator([{key: ex[key] for key in PADDED} for ex in batch]))
        out.update({key: [ex[key] for ex in batch] for key in batch[0] if key not in out})
        return out
