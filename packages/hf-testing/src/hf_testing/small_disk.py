"""A size-limited tmpfs: a real disk that fills up, for runs whose checkpoint save must run
out of space (mounting needs root; no pytest import here, the fault trials use it too).

A run's first checkpoint must fit and a later one must not, whatever a checkpoint of the
model weighs: :func:`leave_room_for_half` shrinks the disk, once the first checkpoint is
written, to what it holds plus half of that checkpoint; :func:`resize` gives the room back
before the run is resumed, as freeing space would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PAGE = 4096


class MountError(RuntimeError):
    """A tmpfs cannot be mounted here (not root, or no mount privilege in this container)."""


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise MountError(f"mount {' '.join(args)}: {done.stderr.strip() or done.returncode}")


@contextmanager
def small_disk(folder: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted on ``folder``, unmounted on the way out (lazily when
    something still holds it, so a failing run never leaves a mount behind)."""
    if os.geteuid() != 0:
        raise MountError("mounting a tmpfs needs root")
    folder.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={_pages(size_bytes)}", "tmpfs", str(folder))
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def resize(folder: Path, size_bytes: int) -> None:
    """Grow or shrink the tmpfs on ``folder`` (never below what it holds)."""
    _mount("-o", f"remount,size={_pages(size_bytes)}", str(folder))


def used_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).used


def leave_room_for_half(folder: Path, checkpoint: Path) -> int:
    """Shrink the tmpfs on ``folder`` to what it holds plus half of ``checkpoint`` (a folder
    on it): the next checkpoint of the same size cannot fit.  Returns the new size."""
    size = used_bytes(folder) + _tree_bytes(checkpoint) // 2
    resize(folder, size)
    return _pages(size)


def _tree_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _pages(size_bytes: int) -> int:
    """``size_bytes`` rounded up to whole pages (tmpfs counts pages)."""
    return -(-size_bytes // PAGE) * PAGE


def latest_saved(output_dir: Path) -> Path | None:
    """The checkpoint a run's ``latest`` names, once one is complete."""
    pointer = output_dir / "checkpoints" / "latest"
    try:
        name = pointer.read_text().strip()
    except OSError:
        return None
    return output_dir / "checkpoints" / name if name else None


def partial_folders(output_dir: Path) -> list[Path]:
    """Every ``*.partial`` under a run folder (an unfinished save's leftovers)."""
    return sorted(output_dir.rglob("*.partial")) if output_dir.exists() else []
