"""Files written beside their destination and renamed into place (run outputs, checkpoints, GGUF files, results)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


def hidden_path_beside(path: Path, create: Callable[[Path], Any]) -> tuple[Path, Any]:
    """A new hidden path beside ``path`` (a rename onto ``path`` is then atomic) and what ``create`` made of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fresh = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return fresh, create(fresh)
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A new file beside ``path``, fsynced and renamed onto it once written (``path`` is never half-written; a failed
    write leaves it intact), with the umask's permissions for outputs that are copied; ``handle.name`` is its path."""
    encoding = {} if "b" in mode else {"encoding": "utf-8"}
    tmp, handle = hidden_path_beside(path, lambda fresh: open(fresh, mode.replace("w", "x"), **encoding))
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path) as handle:
        handle.write(text)
    return path


def atomic_write_json(path: Path, data: Any) -> Path:
    """Write JSON to ``path`` atomically (see :func:`atomic_write_text`); non-serialisable values as ``str``."""
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
