"""Reading prompt records from local JSONL / JSON / Parquet files, and writing JSONL atomically.

Formats, chosen by the file suffix:

* ``.jsonl`` / ``.ndjson`` - one JSON object per line; blank lines are skipped.
* ``.json`` - a JSON array of objects, or JSON Lines when the file does not start with ``[``.
* ``.parquet`` / ``.pq`` - read with ``pyarrow`` (an optional dependency); nested columns
  (a chat ``messages`` list of structs) come back as Python lists of dicts.

Every error names the file, and for a bad line its 1-based line number.  Reading is all or
nothing: a loader that fails on line 9,000 returns no partial list.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_core.atomic import replaced_atomically
from hf_core.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True)
class RecordLocation:
    """Where a record came from: its file, 0-based record number there, 1-based line (JSONL)."""

    path: Path
    record: int
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.path}: record {self.record}"
        return where + (f" (line {self.line})" if self.line is not None else "")


def _absolute(path: Path) -> str:
    """`` (absolute: ...)`` for a relative path: relative to which folder is the usual doubt."""
    return "" if path.is_absolute() else f" (absolute: {path.absolute()})"


def _check_exists(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"prompt dataset not found: {path}{_absolute(path)}")
    if not path.is_file():
        raise DataError(f"prompt dataset {path} is not a file")


def check_dataset_file(path: str | os.PathLike[str], *, key: str = "dataset") -> None:
    """Raise :class:`DataError` naming ``key`` (e.g. ``data.train_files[0]``) unless ``path`` is
    a non-empty file of a supported type -- the cheap checks a run makes before it starts,
    without reading the records."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{key}: prompt dataset {path} does not exist{_absolute(path)}")
    if not path.is_file():
        raise DataError(f"{key}: prompt dataset {path} is not a file")
    suffix = path.suffix.lower()
    if suffix not in JSONL_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES:
        supported = ", ".join(JSONL_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES)
        raise DataError(
            f"{key}: {path}: unsupported file type {suffix!r}; expected one of {supported}"
        )
    if path.stat().st_size == 0:
        raise DataError(f"{key}: prompt dataset {path} is empty (no prompts)")


def _read_jsonl(path: Path) -> list[tuple[dict[str, Any], RecordLocation]]:
    out: list[tuple[dict[str, Any], RecordLocation]] = []
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))  # columns within the line
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}: line {line_no}: malformed JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(value, dict):
                raise DataError(
                    f"{path}: line {line_no}: expected a JSON object, got {type(value).__name__}"
                )
            out.append((value, RecordLocation(path, len(out), line_no)))
    return out


def _read_json(path: Path) -> list[tuple[dict[str, Any], RecordLocation]]:
    with path.open("r", encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("["):
        return _read_jsonl(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}: line {e.lineno}: malformed JSON ({e.msg} at column {e.colno})"
        ) from None
    out = []
    for i, value in enumerate(values):
        if not isinstance(value, dict):
            raise DataError(
                f"{path}: record {i}: expected a JSON object, got {type(value).__name__}"
            )
        out.append((value, RecordLocation(path, i)))
    return out


def _read_parquet(path: Path) -> list[tuple[dict[str, Any], RecordLocation]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: cannot read Parquet: {e}") from e
    return [(row, RecordLocation(path, i)) for i, row in enumerate(rows)]


def read_records(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
) -> list[tuple[dict[str, Any], RecordLocation]]:
    """Every record of ``paths`` (one file or several, concatenated in order) with its location.

    Raises :class:`FileNotFoundError` naming a missing path (before reading any file) and
    :class:`DataError` naming the file and line for malformed content.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    files = [Path(p) for p in paths]
    if not files:
        raise DataError("no prompt dataset files given")
    for path in files:
        _check_exists(path)
    out: list[tuple[dict[str, Any], RecordLocation]] = []
    for path in files:
        suffix = path.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            out += _read_jsonl(path)
        elif suffix in JSON_SUFFIXES:
            out += _read_json(path)
        elif suffix in PARQUET_SUFFIXES:
            out += _read_parquet(path)
        else:
            supported = ", ".join(JSONL_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES)
            raise DataError(
                f"{path}: unsupported file type {suffix!r}; expected one of {supported}"
            )
    return out


def write_jsonl(records: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write ``records`` as JSON Lines, atomically: the file appears whole or not at all.

    The rows go to a temporary file in the same folder which then replaces ``path``, so a crash
    or an unserialisable record never leaves a half-written dataset.  Returns the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for i, record in enumerate(records):
            try:
                line = json.dumps(dict(record), ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise DataError(f"{path}: record {i} is not JSON-serialisable: {e}") from e
            f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path
