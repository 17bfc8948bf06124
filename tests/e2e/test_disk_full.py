"""A disk that fills up during a checkpoint save, in a real ``hybridflow run``.

The run's output folder is a tmpfs, shrunk once the step-2 checkpoint is written to what it
holds plus half a checkpoint, so the step-4 save runs out of space.  The run must exit 1 with
one message naming the failed save, the room a checkpoint takes against the room free, the
intact step-2 checkpoint and the command that resumes, and leave no ``.partial``.  With the
room back, ``--resume`` must start right after step 2 (the rows of steps 3-4 are written
anew, after the failure) and finish every step.  Needs root to mount; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from conftest import LONG, RECIPES

from hf_testing.small_disk import (
    MountError,
    latest_saved,
    leave_room_for_half,
    partial_folders,
    resize,
    small_disk,
)

STEPS, SAVE_EVERY = 4, 2
DISK_BYTES = 64 * 2**20
"""The tmpfs before it is shrunk and after the room comes back: a whole run."""
DEADLINE_S = 300


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with ExitStack() as stack:
        try:
            mount = stack.enter_context(small_disk(tmp_path / "disk", DISK_BYTES))
        except MountError as exc:
            pytest.skip(f"cannot mount a size-limited tmpfs here: {exc}")
        yield mount


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """The runs' own Ray folder (not the session cluster's): short, for Ray's socket paths."""
    folder = Path(tempfile.mkdtemp(prefix="hf-disk-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class Run:
    """``hybridflow run`` in its own process group, its own Ray, its output in files."""

    def __init__(self, workdir: Path, out: Path, logs: Path, ray_tmp: Path) -> None:
        self.workdir, self.out, self.logs, self.ray_tmp = workdir, out, logs, ray_tmp

    def start(self, *extra: str) -> subprocess.Popen:
        name = "resume" if extra else "first"
        overrides = [
            f"run.output_dir={self.out}",
            f"run.total_steps={STEPS}",
            f"run.save_every={SAVE_EVERY}",
            "run.val_every=0",
            "run.progress=false",
            "rollout.max_new_tokens=4",
            "cluster.num_cpus=4",
        ]
        cmd = [sys.executable, "-m", "hf_core.cli", "run", str(RECIPES / "grpo.yaml")]
        env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(self.ray_tmp))
        env.pop("RAY_ADDRESS", None)
        with (
            (self.logs / f"{name}.out").open("w") as out,
            (self.logs / f"{name}.err").open("w") as err,
        ):
            return subprocess.Popen(
                [*cmd, *overrides, *extra],
                cwd=self.workdir,
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own group: killed whole if it hangs
            )

    def stderr(self, name: str) -> str:
        return (self.logs / f"{name}.err").read_text()


def _wait(proc: subprocess.Popen) -> int:
    """The exit code; the whole process group is killed if it outlives the deadline."""
    try:
        return proc.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the run did not end within {DEADLINE_S} s") from None


def _wait_for_checkpoint(proc: subprocess.Popen, out: Path) -> Path:
    deadline = time.monotonic() + DEADLINE_S
    while (checkpoint := latest_saved(out)) is None:
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within the deadline"
        time.sleep(0.05)
    return checkpoint


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@LONG  # the default run: hf-core test_checkpoints (a save on a full disk, a failing save)
def test_a_disk_that_fills_up_mid_save_fails_clearly_and_resumes_from_the_last_checkpoint(
    in_workdir: Path, disk: Path, ray_tmp: Path, tmp_path: Path
) -> None:
    out = disk / "run"
    run = Run(in_workdir, out, tmp_path, ray_tmp)
    first = run.start()
    try:
        step_2 = _wait_for_checkpoint(first, out)
        leave_room_for_half(disk, step_2)  # step 4's checkpoint, as large, cannot fit
        code = _wait(first)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    failed_at = time.time()

    err = " ".join(run.stderr("first").split())
    assert code == 1, err
    assert step_2.name == "step_2", step_2
    assert (
        f"error: the run failed: the checkpoint of step 4 could not be written to "
        f"{out / 'checkpoints'}: no space left on device" in err
    )
    assert re.search(r"a checkpoint of this run takes [\d.]+ MiB; [\d.]+ MiB free", err), err
    assert "The previous checkpoint (step_2) is intact" in err, err
    assert re.search(r"Resume with: hybridflow run \S+ .* --resume", err), err
    assert "Traceback" not in err, err
    assert partial_folders(out) == []  # the failed save removed its own
    assert latest_saved(out) == step_2

    resize(disk, DISK_BYTES)  # the room comes back, as when space is freed
    resumed = run.start("--resume")
    code = _wait(resumed)
    err = " ".join(run.stderr("resume").split())
    assert code == 0, err
    assert f"resumed from {step_2} at step 2" in err, err
    assert "dropped 2 rows after step 2" in err, err
    assert partial_folders(out) == []
    assert latest_saved(out) == out / "checkpoints" / f"step_{STEPS}"

    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    kept = [r for r in rows if r["step"] <= 2]
    redone = [r for r in rows if r["step"] > 2]
    assert all(r["timestamp"] < failed_at for r in kept), "steps 1-2 were trained again"
    assert all(r["timestamp"] > failed_at for r in redone), "steps 3-4 are the failed run's"
