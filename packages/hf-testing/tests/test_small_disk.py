"""The small disk: a real tmpfs that fills up, shrinks to half a checkpoint's room and grows
back, and is never left mounted."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from hf_testing.small_disk import (
    MountError,
    latest_saved,
    leave_room_for_half,
    partial_folders,
    resize,
    small_disk,
)

MiB = 2**20


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with ExitStack() as stack:
        try:
            mount = stack.enter_context(small_disk(tmp_path / "disk", 8 * MiB))
        except MountError as exc:
            pytest.skip(f"cannot mount a size-limited tmpfs here: {exc}")
        yield mount


def _mounted(folder: Path) -> bool:
    return f" {folder} " in Path("/proc/mounts").read_text()


def test_half_a_checkpoint_of_room_refuses_the_next_one_until_the_room_comes_back(
    disk: Path,
) -> None:
    out = disk / "run"
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    (out / "checkpoints" / "step_2" / "weights.bin").write_bytes(os.urandom(2 * MiB))
    (out / "checkpoints" / "latest").write_text("step_2")
    assert latest_saved(out) == out / "checkpoints" / "step_2"
    leave_room_for_half(disk, out / "checkpoints" / "step_2")
    with pytest.raises(OSError) as info:
        (out / "next.bin").write_bytes(os.urandom(2 * MiB))
    assert info.value.errno == errno.ENOSPC
    resize(disk, 8 * MiB)
    (out / "next.bin").write_bytes(os.urandom(2 * MiB))
    assert partial_folders(out) == []
    (out / "checkpoints" / "step_4.partial").mkdir()
    assert partial_folders(out) == [out / "checkpoints" / "step_4.partial"]


def test_the_disk_is_unmounted_even_when_the_body_fails(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    try:
        with small_disk(folder, MiB):
            assert _mounted(folder)
            raise RuntimeError("the run failed")
    except MountError as exc:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {exc}")
    except RuntimeError:
        pass
    assert not _mounted(folder)


def test_without_root_it_is_a_mount_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(MountError, match="needs root"), small_disk(tmp_path / "disk", MiB):
        pass
