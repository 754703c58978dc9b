"""Batching of tokenized task examples: right padding, attention masks, ``-100`` labels."""

from __future__ import annotations

from typing import Any

import torch

IGNORE = -100
Example = dict[str, Any]


def collate(batch: list[Example], pad_id: int) -> dict[str, Any]:
    """Right-pad ``input_ids``/``labels`` into tensors with an ``attention_mask``; keep other keys as lists.

    Args:
        batch: Examples from :meth:`Task.build`.
        pad_id: The tokenizer's pad token id.
    """
    width = max(len(ex["input_ids"]) for ex in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ex in enumerate(batch):
        n = len(ex["input_ids"])
        ids[i, :n] = torch.tensor(ex["input_ids"])
        labels[i, :n] = torch.tensor(ex["labels"])
        mask[i, :n] = 1
    out: dict[str, Any] = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    for key in batch[0]:
        if key not in out:
            out[key] = [ex[key] for ex in batch]
    return out
