"""Fault-injection trials on real GRPO runs (``nox -s faults``; not in the default matrix).

Each kind of fault is injected into a short ``hybridflow run recipes/grpo.yaml`` (tiny assets,
a private Ray instance per trial), ``--trials N`` times:

* ``kill``     SIGKILL one worker process mid-run: the run must heal by itself (one restart
               from its latest checkpoint) and finish;
* ``freeze``   SIGSTOP one worker process: reported within ``cluster.failure_timeout_s`` with
               stacks dumped, then healed as above;
* ``freeze-stop`` the same with ``run.max_restarts=0``: the run must end within
               ``cluster.failure_timeout_s`` + 5 s of the freeze, stacks dumped; ``--resume``
               then finishes it;
* ``sigint``   Ctrl-C (SIGINT to the driver's whole process group, as a terminal sends it):
               the driver must exit promptly; ``--resume`` then finishes the run;
* ``save-kill`` SIGKILL the whole run while a checkpoint is being written: ``--resume`` must
               continue from the last complete checkpoint and finish;
* ``enospc``   the run's disk (a tmpfs, root only) is shrunk after the first checkpoint to
               half a checkpoint's room, so the next save runs out of space: the run must exit
               1 naming the full disk and the intact checkpoint, leaving no ``.partial``; with
               the room back ``--resume`` must continue from that checkpoint and finish.

Counted per trial: a hang (a deadline passed), leftover processes (any process still carrying
the trial's environment marker some seconds after the end: killed, then counted), lost steps
(steps of 1..total missing from the final metrics.jsonl, or out of order) and redone steps
(work a fault cost: rows dropped on resume).  Prints one table row per kind.

    python faults/trials.py --trials 2 --kinds kill,freeze
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from hf_testing.ray_nodes import marked_processes
from hf_testing.small_disk import (
    MountError,
    latest_saved,
    leave_room_for_half,
    partial_folders,
    resize,
    small_disk,
)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo.yaml"
MARKER = "HF_FAULT_TRIAL"
KINDS = ("kill", "freeze", "freeze-stop", "sigint", "save-kill", "enospc")
FAILURE_TIMEOUT_S = 10
STOP_MARGIN_S = 5.0
"""A frozen worker with no restarts left must end the run this soon after the timeout."""
DISK_BYTES = 64 * 2**20
"""The enospc trial's tmpfs before it is shrunk and after the room comes back: a whole run."""


@dataclasses.dataclass
class Outcome:
    kind: str
    ok: bool = False
    hang: bool = False
    leftovers: int = 0
    lost_steps: int = 0
    redone_steps: int = 0
    seconds: float = 0.0
    note: str = ""


@dataclasses.dataclass
class Trial:
    """One run folder, one Ray temp folder and one marker: everything a trial starts."""

    workdir: Path
    steps: int
    deadline_s: float
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    ray_dirs: list[str] = dataclasses.field(default_factory=list)
    max_restarts: int = 1
    disk: Path | None = None
    """Where the run folder lives when not under ``runs/`` (the enospc trial's small disk);
    its logs stay in ``runs/``."""

    @property
    def logs(self) -> Path:
        return self.workdir / "runs"

    @property
    def out(self) -> Path:
        return (self.disk or self.logs) / f"trial_{self.token[:8]}"

    def env(self) -> dict[str, str]:
        ray_tmp = tempfile.mkdtemp(prefix="hff-", dir="/tmp")  # short unix socket paths
        self.ray_dirs.append(ray_tmp)
        env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, **{MARKER: self.token})
        env.pop("RAY_ADDRESS", None)
        return env

    def command(self, resume: bool = False) -> list[str]:
        overrides = [
            f"run.output_dir={self.out}",
            f"run.total_steps={self.steps}",
            "run.save_every=2",
            f"run.max_restarts={self.max_restarts}",
            "run.val_every=0",
            "run.progress=false",
            "rollout.max_new_tokens=4",
            "cluster.num_cpus=4",
            f"cluster.failure_timeout_s={FAILURE_TIMEOUT_S}",
        ]
        cmd = [sys.executable, "-m", "hf_core.cli", "run", str(RECIPE), *overrides]
        return [*cmd, "--resume"] if resume else cmd

    def start(self, resume: bool = False) -> subprocess.Popen:
        log = (self.logs / f"{self.out.name}{'_resume' if resume else ''}.log").open("w")
        return subprocess.Popen(
            self.command(resume),
            cwd=self.workdir,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: Ctrl-C and kill -9 of "the run"
        )

    def log_text(self) -> str:
        return "".join(p.read_text() for p in sorted(self.logs.glob(f"{self.out.name}*.log")))

    def metrics_steps(self) -> list[int]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, what: Callable[[], bool], proc: subprocess.Popen, poll_s: float) -> bool:
        deadline = time.monotonic() + self.deadline_s
        while time.monotonic() < deadline:
            if what():
                return True
            if proc.poll() is not None:
                return False
            time.sleep(poll_s)
        return False

    def finish(self, proc: subprocess.Popen) -> bool:
        """Wait for the driver; False (a hang) if it outlives the deadline (then killed)."""
        try:
            proc.wait(timeout=self.deadline_s)
            return True
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return False

    def workers(self) -> list[int]:
        """Pids of the run's worker processes (Ray titles them ``ray::WorkerProcess...``)."""
        return sorted(
            pid
            for pid, cmd in marked_processes(self.token, MARKER).items()
            if "WorkerProcess" in cmd
        )

    def leftovers(self, grace_s: float = 20.0) -> int:
        """Processes of this trial still alive ``grace_s`` after its end (then killed)."""
        deadline = time.monotonic() + grace_s
        while (left := marked_processes(self.token, MARKER)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            _signal(pid, signal.SIGKILL)
        if left:
            print(f"  leftover: {left}", flush=True)
        return len(left)

    def lost_and_redone(self) -> tuple[int, int]:
        steps = self.metrics_steps()
        lost = 0 if steps == list(range(1, self.steps + 1)) else self.steps - len(set(steps))
        lost = max(lost, 1) if steps != sorted(set(steps)) else lost
        dropped = sum(int(n) for n in re.findall(r"dropped (\d+) rows after step", self.log_text()))
        return lost, dropped


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _reached(trial: Trial, step: int) -> Callable[[], bool]:
    return lambda: any(s >= step for s in trial.metrics_steps())


# ---------------------------------------------------------------------- kinds


def _heal(trial: Trial, outcome: Outcome, sig: signal.Signals) -> None:
    """Hit one worker with ``sig`` after step 3; the run must finish by itself."""
    proc = trial.start()
    if not trial.wait_for(_reached(trial, 3), proc, 0.2) or not trial.workers():
        outcome.note = "run ended before the fault"
    else:
        _signal(trial.workers()[-1], sig)
    outcome.hang = not trial.finish(proc)
    restarted = "restart 1/1" in trial.log_text()
    outcome.ok = not outcome.hang and proc.returncode == 0 and restarted
    if sig == signal.SIGSTOP and not any((trial.out / "stacks").glob("*.txt")):
        outcome.ok, outcome.note = False, "no stacks dumped"


def run_kill(trial: Trial, outcome: Outcome) -> None:
    _heal(trial, outcome, signal.SIGKILL)


def run_freeze(trial: Trial, outcome: Outcome) -> None:
    _heal(trial, outcome, signal.SIGSTOP)


def run_freeze_stop(trial: Trial, outcome: Outcome) -> None:
    """SIGSTOP one worker after step 3 with no restarts allowed: the run must end (failed,
    stacks dumped) within the failure timeout + STOP_MARGIN_S of the freeze; --resume then
    finishes it."""
    trial.max_restarts = 0
    proc = trial.start()
    if not trial.wait_for(_reached(trial, 3), proc, 0.2) or not trial.workers():
        outcome.note = "run ended before the fault"
        outcome.hang = not trial.finish(proc)
        return
    _signal(trial.workers()[-1], signal.SIGSTOP)
    frozen = time.monotonic()
    outcome.hang = not trial.finish(proc)
    ended = time.monotonic() - frozen
    bound = FAILURE_TIMEOUT_S + STOP_MARGIN_S
    stacks = any((trial.out / "stacks").glob("*.txt"))
    outcome.note = f"ended {ended:.1f} s after the freeze (bound {bound:.0f} s)"
    if not stacks:
        outcome.note += "; no stacks dumped"
    outcome.leftovers += trial.leftovers()
    resumed = trial.start(resume=True)
    outcome.hang |= not trial.finish(resumed)
    outcome.ok = (
        not outcome.hang
        and proc.returncode != 0
        and stacks
        and ended <= bound
        and resumed.returncode == 0
    )


def run_sigint(trial: Trial, outcome: Outcome) -> None:
    """Ctrl-C after step 3: the driver must exit within 60 s; --resume finishes the run."""
    proc = trial.start()
    if not trial.wait_for(_reached(trial, 3), proc, 0.2):
        outcome.note = "run ended before the fault"
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        outcome.hang = True
        _kill_group(proc)
    outcome.leftovers += trial.leftovers()
    resumed = trial.start(resume=True)
    outcome.hang |= not trial.finish(resumed)
    outcome.ok = not outcome.hang and proc.returncode != 0 and resumed.returncode == 0


def run_save_kill(trial: Trial, outcome: Outcome) -> None:
    """SIGKILL the run's whole process group while a checkpoint is half written (not the
    first one: a run killed before any checkpoint exists has nothing to resume from)."""
    proc = trial.start()
    root = trial.out / "checkpoints"

    def saving() -> bool:
        if not (root / "latest").is_file():
            return False
        return any(p.name.endswith(".partial") for p in root.iterdir())

    caught = trial.wait_for(saving, proc, 0.005)
    _kill_group(proc)
    outcome.leftovers += trial.leftovers()
    if not caught:
        outcome.note = "no save caught in progress"
    resumed = trial.start(resume=True)
    outcome.hang = not trial.finish(resumed)
    outcome.ok = caught and not outcome.hang and resumed.returncode == 0


def run_enospc(trial: Trial, outcome: Outcome) -> None:
    """The run folder on a tmpfs that fills up during the second checkpoint save; the folder
    is copied back under ``runs/`` before the tmpfs goes, for the step counts."""
    mount = trial.workdir / f"disk_{trial.token[:8]}"
    try:
        with small_disk(mount, DISK_BYTES):
            trial.disk = mount
            try:
                _fill_then_resume(trial, outcome, mount)
            finally:
                outcome.leftovers += trial.leftovers()  # nothing may hold the disk now
                if trial.out.exists():
                    shutil.copytree(trial.out, trial.logs / trial.out.name)
                trial.disk = None
    except MountError as exc:
        outcome.note = f"no small disk: {exc}"


def _fill_then_resume(trial: Trial, outcome: Outcome, mount: Path) -> None:
    """Shrink the disk once the first checkpoint is saved; the run must fail as a full disk
    with no ``.partial`` left, then ``--resume`` (the room back) must finish from it."""
    proc = trial.start()
    if not trial.wait_for(lambda: latest_saved(trial.out) is not None, proc, 0.05):
        outcome.note = "run ended before its first checkpoint"
        outcome.hang = not trial.finish(proc)
        return
    checkpoint = latest_saved(trial.out)
    assert checkpoint is not None
    leave_room_for_half(mount, checkpoint)
    outcome.hang = not trial.finish(proc)
    outcome.leftovers += trial.leftovers()
    said = _says_disk_full(trial.log_text(), checkpoint)
    left = partial_folders(trial.out)
    resize(mount, DISK_BYTES)  # the room comes back, as when space is freed
    resumed = trial.start(resume=True)
    outcome.hang |= not trial.finish(resumed)
    from_it = f"resumed from {checkpoint} at step" in trial.log_text()
    left += partial_folders(trial.out)
    outcome.note = f"exit {proc.returncode}, then {resumed.returncode}"
    outcome.note += "" if said else "; no full-disk message naming the intact checkpoint"
    outcome.note += f"; left {[str(p) for p in left]}" if left else ""
    outcome.note += "" if from_it else f"; the resume did not start from {checkpoint.name}"
    outcome.ok = (
        not outcome.hang
        and proc.returncode == 1
        and said
        and not left
        and resumed.returncode == 0
        and from_it
    )


def _says_disk_full(log: str, checkpoint: Path) -> bool:
    """The driver's error names the failed save, the full disk, the room a checkpoint takes
    against the room free, and the checkpoint left intact with the command to resume."""
    error = " ".join(line for line in log.splitlines() if line.startswith("error: "))
    return all(
        re.search(pattern, error)
        for pattern in (
            r"the checkpoint of step \d+ could not be written to \S+: no space left on device",
            r"a checkpoint of this run takes [\d.]+ [KM]iB; [\d.]+ [KM]iB free",
            re.escape(f"The previous checkpoint ({checkpoint.name}) is intact"),
            r"Resume with: hybridflow .* --resume",
        )
    )


RUNNERS: dict[str, Callable[[Trial, Outcome], None]] = {
    "kill": run_kill,
    "freeze": run_freeze,
    "freeze-stop": run_freeze_stop,
    "sigint": run_sigint,
    "save-kill": run_save_kill,
    "enospc": run_enospc,
}


# ---------------------------------------------------------------------- driver


def _make_assets(workdir: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "make_assets", ROOT / "recipes" / "make_assets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_assets(workdir / "runs" / "assets")


def run_trial(kind: str, workdir: Path, steps: int, deadline_s: float) -> Outcome:
    trial = Trial(workdir, steps, deadline_s)
    trial.out.parent.mkdir(parents=True, exist_ok=True)
    outcome = Outcome(kind)
    start = time.monotonic()
    try:
        RUNNERS[kind](trial, outcome)
    finally:
        outcome.leftovers += trial.leftovers()
        outcome.seconds = time.monotonic() - start
        for folder in trial.ray_dirs:
            shutil.rmtree(folder, ignore_errors=True)
    outcome.lost_steps, outcome.redone_steps = trial.lost_and_redone()
    outcome.ok &= outcome.lost_steps == 0 and outcome.leftovers == 0
    return outcome


def table(outcomes: list[Outcome]) -> str:
    head = f"{'fault':<12} {'trials':>6} {'ok':>4} {'hangs':>6} {'leftover procs':>14} "
    head += f"{'lost steps':>10} {'redone steps':>12} {'mean s':>7}"
    rows = [head, "-" * len(head)]
    for kind in KINDS:
        mine = [o for o in outcomes if o.kind == kind]
        if not mine:
            continue
        rows.append(
            f"{kind:<12} {len(mine):>6} {sum(o.ok for o in mine):>4} "
            f"{sum(o.hang for o in mine):>6} {sum(o.leftovers for o in mine):>14} "
            f"{sum(o.lost_steps for o in mine):>10} {sum(o.redone_steps for o in mine):>12} "
            f"{sum(o.seconds for o in mine) / len(mine):>7.0f}"
        )
    notes = [f"  {o.kind}: {o.note}" for o in outcomes if o.note]
    return "\n".join(rows + (["notes:", *notes] if notes else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="trials of each kind")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {','.join(KINDS)}")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds before a hang")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary one")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hf-faults-"))
    _make_assets(workdir)
    outcomes = []
    for i in range(args.trials):
        for kind in kinds:
            outcome = run_trial(kind, workdir, args.steps, args.deadline)
            outcomes.append(outcome)
            print(
                f"trial {i + 1}/{args.trials} {kind}: ok={outcome.ok} hang={outcome.hang} "
                f"leftovers={outcome.leftovers} lost={outcome.lost_steps} "
                f"redone={outcome.redone_steps} {outcome.seconds:.0f} s {outcome.note}",
                flush=True,
            )
    print(table(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
