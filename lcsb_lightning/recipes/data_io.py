"""Reading task files (text, JSON lines, TSV/CSV) through ``datasets.load_dataset``, with errors that say why."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

DATA_HINT = (
    "name an existing file, or run the preset without data_dir to load its data set from the Hugging Face "
    "hub (needs network, or the data set in the local Hugging Face cache)"
)
FORMATS = ("tsv", "csv", "jsonl")
EXTENSIONS = {".tsv": "tsv", ".txt": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}


def require_file(path: str | Path, data_dir: str | Path | None = None, hint: str | None = None) -> Path:
    """The resolved path of an existing file.

    Args:
        path: The file path from the config.
        data_dir: Folder that a relative ``path`` is under (``data_dir=`` of the presets); None: as is.
        hint: How to get the data, for the error; defaults to :data:`DATA_HINT`.

    Raises:
        FileNotFoundError: The file does not exist.
    """
    p = Path(path).expanduser()
    if data_dir is not None and not p.is_absolute():
        p = Path(data_dir).expanduser() / p
    p = p.resolve()
    if not p.is_file():
        given = "" if str(path) == str(p) else f" (configured as {str(path)!r}" + (f" under data_dir={str(data_dir)!r})" if data_dir else ")")
        raise FileNotFoundError(f"data file not found: {p}{given}; {hint or DATA_HINT}")
    return p


def _datasets(what: str) -> Any:
    """The ``datasets`` module, or an ImportError saying how to install it for reading ``what``."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"reading {what} needs the `datasets` package: pip install 'lcsb-lightning[recipes]' "
                          "(or pip install datasets)") from exc
    return datasets


def _not_utf8(path: Path, exc: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); convert it, e.g. iconv -t utf-8")


def _load(builder: str, path: Path, what: str, **kwargs: Any) -> Any:
    """``datasets.load_dataset`` of one file; a ValueError naming it where it is not UTF-8 or not valid ``what``."""
    datasets = _datasets(str(path))
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a few local files: the bars would say nothing
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except StopIteration as exc:  # the json builder's answer to a file without a line
        raise ValueError(f"{path} holds no rows") from exc
    except (datasets.exceptions.DatasetGenerationError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        cause = exc.__cause__ or exc
        if isinstance(cause, UnicodeDecodeError):
            raise _not_utf8(path, cause) from exc
        reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise ValueError(f"{path} is not valid {what} ({reason})") from exc
    finally:
        if shown:
            datasets.enable_progress_bars()


def read_text(path: Path, max_chars: int | None = None) -> str:
    """A UTF-8 text file as one document, cut to its first ``max_chars`` characters if given.

    Raises:
        ValueError: the file is empty, or not UTF-8 (the message names the byte offset).
    """
    rows = _load("text", path, "text", sample_by="document")
    text = rows[0]["text"] if len(rows) else ""
    text = text[:max_chars] if max_chars else text
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def read_table(path: Path, fmt: str = "auto", header: bool = True) -> tuple[list[str], list[dict[str, Any]]]:
    """The column names and the rows (keyed by column name) of a TSV, CSV or JSONL file, with ``datasets.load_dataset``.

    TSV and CSV cells stay strings (no number parsing, no ``NA`` -> missing); TSV cells are not quoted
    (SST-2's sentences hold quote characters). Without a ``header``, columns are named ``"0"``, ``"1"``, ...

    Args:
        fmt: ``auto`` (from the extension), ``tsv``, ``csv`` or ``jsonl``.
        header: Whether the first TSV/CSV line holds column names.

    Raises:
        ValueError: an unknown format, or a file that is not UTF-8, cannot be parsed, or holds no rows.
    """
    if fmt not in ("auto", *FORMATS):
        raise ValueError(f"unknown format {fmt!r}; use auto, tsv, csv or jsonl")
    kind = EXTENSIONS.get(path.suffix.lower()) if fmt == "auto" else fmt
    if kind is None:
        raise ValueError(f"cannot tell the format of {path} from its extension; set format: tsv, csv or jsonl")
    if kind == "jsonl":
        ds = _load("json", path, "JSON lines (one object per line)")
    else:
        datasets = _datasets(str(path))
        delimiter, quoting = ("\t", csv.QUOTE_NONE) if kind == "tsv" else (",", csv.QUOTE_MINIMAL)
        try:  # the column names (to read every column as strings), and whether there is a row
            with path.open(encoding="utf-8", newline="") as fh:
                lines = list(islice(filter(None, csv.reader(fh, delimiter=delimiter, quoting=quoting)), 2))
        except UnicodeDecodeError as exc:
            raise _not_utf8(path, exc) from exc
        if len(lines) <= int(header):
            raise ValueError(f"{path} holds no rows")
        columns = [c.strip() for c in lines[0]] if header else [str(i) for i in range(len(lines[0]))]
        features = datasets.Features({c: datasets.Value("string") for c in columns})
        ds = _load("csv", path, kind.upper(), delimiter=delimiter, quoting=quoting, column_names=columns, index_col=False,
                   skiprows=1 if header else None, features=features, keep_default_na=False, na_filter=False)
    if not len(ds):
        raise ValueError(f"{path} holds no rows")
    return list(ds.column_names), ds.to_list()


def column_name(columns: Sequence[str], column: str | int, role: str, path: Path) -> str:
    """The name of ``column``, given by name or 0-based position among ``columns``.

    Args:
        role: What the column is for, e.g. ``"text_column"``, and ``path`` the file: both named in the error.

    Raises:
        KeyError: no such column (the columns seen are listed).
    """
    if isinstance(column, int) or (isinstance(column, str) and column.isdigit() and column not in columns):
        idx = int(column)
        if 0 <= idx < len(columns):
            return columns[idx]
        raise KeyError(f"{role}={column!r}: {path} has only {len(columns)} columns: {list(columns)}")
    if column not in columns:
        raise KeyError(f"{role}={column!r} not found in {path}; columns seen: {list(columns)}")
    return str(column)


def check_fields(columns: Sequence[str], fields: Sequence[str], path: Path) -> None:
    """Raise a KeyError naming the missing fields and listing the fields seen (``columns``)."""
    missing = [f for f in fields if f not in columns]
    if missing:
        raise KeyError(f"field(s) {missing} not found in {path}; fields seen: {list(columns)}")


HUB_KEYS = ("path", "name", "train_split", "eval_split", "text_field")


def check_hub(hub: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a ``hub:`` node (before any download) and return it as a dict."""
    unknown = sorted(set(hub) - set(HUB_KEYS))
    if unknown or "path" not in hub:
        raise ValueError(f"hub: needs `path` and takes only {', '.join(HUB_KEYS)}; got {dict(hub)}")
    return dict(hub)


def load_hub_rows(hub: Mapping[str, Any], split: str) -> list[dict[str, Any]]:
    """The rows of one split of a data set, ``datasets.load_dataset(hub["path"], hub.get("name"), split=split)``.

    Args:
        hub: The ``hub:`` node; its ``path`` is a hub id (network, or the local cache) or a hub-style local folder.

    Raises:
        ImportError: ``datasets`` is not installed.
        ConnectionError: the data set could be reached neither on the hub nor in the local cache.
    """
    datasets = _datasets(f"{hub['path']!r} from the Hugging Face hub")
    try:
        ds = datasets.load_dataset(hub["path"], hub.get("name"), split=split)
    except (ConnectionError, OSError) as exc:
        raise ConnectionError(
            f"could not load {hub['path']!r} (config {hub.get('name')!r}, split {split!r}) from the Hugging Face "
            f"hub or its local cache ({exc}); without network, give data_dir= with local files"
        ) from exc
    return [dict(r) for r in ds]
