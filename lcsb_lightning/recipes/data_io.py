"""Reading task files (text, JSON lines, TSV/CSV) with errors that say what was expected and what was seen."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

DATA_HINT = (
    "name an existing file, or run the preset without data_dir to load its data set from the Hugging Face "
    "hub (needs network, or the data set in the local Hugging Face cache)"
)


def resolve_path(path: str | Path, data_dir: str | Path | None = None) -> Path:
    """A data path from a config: under ``data_dir`` when one is given, else as is (relative to the working directory)."""
    p = Path(path).expanduser()
    if data_dir is not None and not p.is_absolute():
        p = Path(data_dir).expanduser() / p
    return p.resolve()


def require_file(path: str | Path, data_dir: str | Path | None = None, hint: str | None = None) -> Path:
    """Return the resolved path of an existing file or raise a FileNotFoundError naming it.

    Args:
        path: The file path from the config.
        data_dir: Folder that relative paths are under (``data_dir=`` of the presets).
        hint: How to get the data; defaults to :data:`DATA_HINT`.

    Raises:
        FileNotFoundError: The file does not exist.
    """
    p = resolve_path(path, data_dir)
    if not p.is_file():
        given = "" if str(path) == str(p) else f" (configured as {str(path)!r}" + (f" under data_dir={str(data_dir)!r})" if data_dir else ")")
        raise FileNotFoundError(f"data file not found: {p}{given}; {hint or DATA_HINT}")
    return p


def read_text(path: Path, max_chars: int | None = None) -> str:
    """Read a UTF-8 text file, optionally only its first ``max_chars`` characters.

    Raises:
        ValueError: the file is empty, or not UTF-8 (the message names the byte offset).
    """
    try:
        with path.open(encoding="utf-8") as fh:
            text = fh.read(max_chars) if max_chars else fh.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); convert it, e.g. iconv -t utf-8") from exc
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a JSON-lines file, naming the line of a syntax error or of bad UTF-8."""
    with path.open(encoding="utf-8", errors="strict") as fh:
        try:
            lines = list(fh)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            yield row


def detect_format(path: Path, fmt: str = "auto") -> str:
    """Return ``tsv``, ``csv`` or ``jsonl`` from ``fmt`` or the file extension."""
    if fmt != "auto":
        if fmt not in ("tsv", "csv", "jsonl"):
            raise ValueError(f"unknown format {fmt!r}; use auto, tsv, csv or jsonl")
        return fmt
    ext = path.suffix.lower()
    if ext in (".tsv", ".txt"):
        return "tsv"
    if ext == ".csv":
        return "csv"
    if ext in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise ValueError(f"cannot tell the format of {path} from its extension; set format: tsv, csv or jsonl")


def read_table(path: Path, fmt: str = "auto", header: bool = True) -> tuple[list[str], list[dict[str, Any]]]:
    """Read a TSV, CSV or JSONL file into rows keyed by column name.

    Without a header, columns are named by position: ``"0"``, ``"1"``, ...

    Args:
        path: The file.
        fmt: ``auto``, ``tsv``, ``csv`` or ``jsonl``.
        header: Whether the first TSV/CSV line holds column names.

    Returns:
        The column names seen and the rows.
    """
    kind = detect_format(path, fmt)
    if kind == "jsonl":
        rows = list(iter_jsonl(path))
        columns = list(rows[0].keys()) if rows else []
        return columns, rows
    delimiter = "\t" if kind == "tsv" else ","
    quoting = csv.QUOTE_NONE if kind == "tsv" else csv.QUOTE_MINIMAL
    try:
        with path.open(encoding="utf-8", newline="") as fh:
            lines = [line for line in csv.reader(fh, delimiter=delimiter, quoting=quoting) if line]
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    if len(lines) <= int(header):
        raise ValueError(f"{path} holds no rows")
    if header:
        columns, body = [c.strip() for c in lines[0]], lines[1:]
    else:
        columns, body = [str(i) for i in range(len(lines[0]))], lines
    rows = [dict(zip(columns, line)) for line in body]
    return columns, rows


def column_name(columns: Sequence[str], column: str | int, role: str, path: Path) -> str:
    """Map a column given by name or position to its name, or raise a KeyError listing the columns seen.

    Args:
        columns: Column names read from the file.
        column: The configured name, or a 0-based position.
        role: What the column is for (used in the error message), e.g. ``"text_column"``.
        path: The file (for the error message).
    """
    if isinstance(column, int) or (isinstance(column, str) and column.isdigit() and column not in columns):
        idx = int(column)
        if 0 <= idx < len(columns):
            return columns[idx]
        raise KeyError(f"{role}={column!r}: {path} has only {len(columns)} columns: {list(columns)}")
    if column not in columns:
        raise KeyError(f"{role}={column!r} not found in {path}; columns seen: {list(columns)}")
    return str(column)


def check_fields(row: Mapping[str, Any], fields: Sequence[str], path: Path) -> None:
    """Raise a KeyError naming the missing fields and listing the fields seen in ``row``."""
    missing = [f for f in fields if f not in row]
    if missing:
        raise KeyError(f"field(s) {missing} not found in {path}; fields seen: {list(row.keys())}")


HUB_KEYS = ("path", "name", "train_split", "eval_split", "text_field")


def check_hub(hub: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a ``hub:`` node (before any download) and return it as a dict."""
    unknown = sorted(set(hub) - set(HUB_KEYS))
    if unknown or "path" not in hub:
        raise ValueError(f"hub: needs `path` and takes only {', '.join(HUB_KEYS)}; got {dict(hub)}")
    return dict(hub)


def load_hub_rows(hub: Mapping[str, Any], split: str) -> list[dict[str, Any]]:
    """Load one split of a data set with ``datasets.load_dataset(path, name, split=split)``.

    ``path`` is a hub id (network, or the local Hugging Face cache) or a local folder laid out as a
    hub data set repository.

    Args:
        hub: ``{path: ..., name: ...}`` as given to ``datasets.load_dataset``.
        split: The split name.

    Returns:
        The rows as dictionaries.

    Raises:
        ImportError: ``datasets`` is not installed.
        ConnectionError: the data set could be reached neither on the hub nor in the local cache.
    """
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError(
            f"loading {hub['path']!r} from the Hugging Face hub needs the `datasets` package: "
            "pip install 'lcsb-lightning[recipes]' (or pip install datasets), or give data_dir= with local files"
        ) from exc
    try:
        ds = datasets.load_dataset(hub["path"], hub.get("name"), split=split)
    except (ConnectionError, OSError) as exc:
        raise ConnectionError(
            f"could not load {hub['path']!r} (config {hub.get('name')!r}, split {split!r}) from the Hugging Face "
            f"hub or its local cache ({exc}); without network, give data_dir= with local files"
        ) from exc
    return [dict(r) for r in ds]
