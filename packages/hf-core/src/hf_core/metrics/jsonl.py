"""The per-step JSONL metrics log: append-only, one complete JSON object per line.

Each row is ``{"step": int, "timestamp": float, "<metric>": float | null, ...}``.  Non-finite
values (NaN, inf) are written as ``null`` (strict JSON) and read back as NaN.

Crash safety: a row is encoded first and written with one ``write`` call on an ``O_APPEND``
descriptor, then flushed (``fsync=True`` also forces it to disk).  A process killed between rows
leaves only complete lines; should a machine crash ever leave a torn last line, opening the log
again trims it (with a warning) and :func:`read_metrics_jsonl` skips it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_core.atomic import replaced_atomically

logger = logging.getLogger("hf_core.metrics")


def to_float(key: str, value: Any) -> float:
    """``value`` as a float (bool, int, float, numpy scalar, one-element array or tensor)."""
    if isinstance(value, bool | int | float | np.number | np.bool_):
        return float(value)
    if isinstance(value, np.ndarray) and value.size == 1:
        return float(value.item())
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}")


def encode_row(step: int, metrics: Mapping[str, float], timestamp: float) -> bytes:
    row: dict[str, Any] = {"step": int(step), "timestamp": round(timestamp, 3)}
    for key, value in metrics.items():
        if key in ("step", "timestamp"):
            raise ValueError(f"metric name {key!r} is reserved in the JSONL log")
        row[key] = value if math.isfinite(value) else None
    return (json.dumps(row, allow_nan=False) + "\n").encode("utf-8")


def _repair_tail(path: Path) -> None:
    """Trim a torn last line (no trailing newline) left by a machine crash."""
    size = path.stat().st_size
    if size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        keep = data.rfind(b"\n") + 1
        logger.warning("%s: removed an incomplete last line (%d bytes)", path, size - keep)
        f.truncate(keep)


class JsonlAppender:
    """Appends encoded rows to a JSONL file, one ``write`` per row, flushed each time."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _repair_tail(self.path)
        self.fsync = fsync
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, data: bytes) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: the metrics log is closed")
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        if self.fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_metrics_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every row of a metrics log (``null`` values as NaN).

    A malformed line is an error naming the file and line number, except an unterminated last
    line (a torn write), which is skipped with a warning.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"metrics log not found: {path}")
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    rows = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not an object with a 'step'")
        except ValueError as e:
            if line_no == len(lines):  # no trailing newline: a torn last write
                logger.warning("%s: skipping incomplete last line %d", path, line_no)
                break
            raise ValueError(f"{path}: line {line_no}: malformed metrics row: {e}") from None
        rows.append({k: (math.nan if v is None else v) for k, v in row.items()})
    return rows


def truncate_metrics_jsonl(path: str | os.PathLike[str], after_step: int) -> int:
    """Drop the rows with ``step > after_step`` (a run resuming from ``after_step``).

    The file is rewritten to a temporary file and swapped in atomically.  Returns the number
    of rows removed; a missing file is nothing to truncate (0).
    """
    path = Path(path)
    if not path.exists():
        return 0
    _repair_tail(path)
    kept, removed = [], 0
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: line {line_no}: malformed metrics row: {e}") from None
            if step <= after_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                removed += 1
    if removed:
        with replaced_atomically(path) as tmp, tmp.open("w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
    return removed
