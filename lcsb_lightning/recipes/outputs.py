"""Run outputs written atomically: the LoRA adapter, ``summary.json``, and process memory figures."""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn


def peak_rss_mb() -> float:
    """Whole-process peak resident set size in MiB (``ru_maxrss``; KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def atomic_write_json(path: Path, data: Any) -> Path:
    """Write JSON to ``path`` through a temporary file and a rename, so no half-written file remains.

    Args:
        path: Destination.
        data: JSON-serialisable object (non-serialisable values are written with ``str``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_adapter(model: nn.Module, path: Path) -> Path:
    """Save a peft model's adapter (``save_pretrained``) atomically into the folder ``path``.

    Args:
        model: A ``peft.PeftModel``.
        path: Destination folder; an existing one is replaced.
    """
    if not hasattr(model, "peft_config"):
        raise TypeError(f"expected a peft model with an adapter, got {type(model).__name__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(str(tmp))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
