"""Files that appear whole or not at all: written beside their target, then renamed over it.

Datasets, metric logs and plots are all replaced this way, so a crash mid-write never leaves a
half-written file where a reader (or a resumed run) would find it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced_atomically(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path in ``path``'s folder to write; when the block succeeds it replaces
    ``path`` (keeping the replaced file's mode, else 0644), when it fails it is removed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp makes 0600 files: keep the mode of the file replaced, else use 0644.
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
