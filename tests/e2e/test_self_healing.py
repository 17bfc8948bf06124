"""Self-healing runs: a worker killed mid-run is replaced and the run resumes by itself.

The done-when check: a 12-step GRPO run whose rank-1 worker is SIGKILLed after step 6 finishes
on its own (one restart, from the step-4 checkpoint) with metrics and final weights equal, bit
for bit, to those of an uninterrupted run.  A deterministic replay from step 0 would be equal
too, so the trainer's record of where each attempt started (``start_steps``) must name the
checkpoint's step; and the run's reward varies within groups, so every update changes the
weights and a restart that restored the wrong ones would show.  The restart policy itself
(what restarts, how many times, from where) is checked without Ray on stubbed groups.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import RECIPES, exported_weights, logged_step_reached, stable_metrics

from hf_core.config import TrainerConfig, load_config
from hf_core.runtime import WorkerError, WorkerLostError
from hf_core.trainer import RLTrainer, run_loop

VOLATILE = ("timing/", "perf/", "memory/", "timestamp", "handover/")
"""Not compared: times, memory peaks and the hand-over's bytes.  The first step after a
restart counts the device moves of the checkpoint restore (none: fresh processes start in
training mode), where the uninterrupted run's counts those of the checkpoint save before it."""
STEPS = 12
SAVE_EVERY = 4
KILL_AFTER_STEP = 6
RESUMED_STEP = KILL_AFTER_STEP // SAVE_EVERY * SAVE_EVERY
"""The latest checkpoint when the kill lands (within a step of step 6, long before step 8)."""


def _config(out: Path, *overrides: str) -> TrainerConfig:
    return load_config(
        TrainerConfig,
        RECIPES / "grpo.yaml",
        [
            f"run.output_dir={out}",
            f"run.total_steps={STEPS}",
            f"run.save_every={SAVE_EVERY}",
            # digits_reverse scores the untrained policy 0: no updates
            "reward.function=hf_testing.signal_rewards:digit_share",
            "run.max_restarts=1",
            "run.export_final=true",
            "run.val_every=0",
            "run.progress=false",
            "rollout.max_new_tokens=4",
            "cluster.failure_timeout_s=10",
            *overrides,
        ],
    )


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


class KillAfterStep(threading.Thread):
    """SIGKILLs one worker process of a running trainer once metrics.jsonl reaches a step:
    from outside, as the OOM killer or a lost machine would."""

    def __init__(self, trainer: RLTrainer, step: int, rank: int = 1) -> None:
        super().__init__(daemon=True)
        self.trainer, self.step, self.rank = trainer, step, rank
        self.killed: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):  # a step takes ~0.1 s: kill within one
            roles = self.trainer.roles
            if roles is not None and logged_step_reached(self.trainer.output_dir, self.step):
                self.killed = roles.actor.pids[self.rank]
                os.kill(self.killed, signal.SIGKILL)
                return


@pytest.mark.usefixtures("ray_cluster")
def test_killed_worker_restarts_and_matches_an_uninterrupted_run(in_workdir: Path) -> None:
    straight_out, healed_out = in_workdir / "runs" / "straight12", in_workdir / "runs" / "healed"
    RLTrainer(_config(straight_out)).fit()

    trainer = RLTrainer(_config(healed_out))
    killer = KillAfterStep(trainer, KILL_AFTER_STEP)
    killer.start()
    start = time.monotonic()
    try:
        trainer.fit()
    finally:
        killer.stop.set()
    assert killer.killed is not None, "the worker was never killed"
    assert len(trainer.restarts) == 1, trainer.restarts
    assert "worker lost" in trainer.restarts[0] and "rank 1" in trainer.restarts[0]
    assert str(healed_out / "stacks") in trainer.restarts[0]
    assert trainer.start_steps == [0, RESUMED_STEP]  # resumed where the checkpoint is, not 0
    assert (healed_out / "checkpoints" / f"step_{RESUMED_STEP}").is_dir()
    assert time.monotonic() - start < 600

    healed, straight = _rows(healed_out), _rows(straight_out)
    assert [r["step"] for r in healed] == list(range(1, STEPS + 1))  # truncated, then redone
    assert all(r["actor/grad_norm"] > 0 for r in straight)  # the weights moved every step
    assert [stable_metrics(r, VOLATILE) for r in healed] == [
        stable_metrics(r, VOLATILE) for r in straight
    ]
    a, b = exported_weights(straight_out), exported_weights(healed_out)
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].equal(b[name]), name


# ---------------------------------------------------------------- restart policy, no Ray


class _Groups:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def shutdown(self) -> None:
        self.log.append("shutdown")


def _policy_trainer(
    in_workdir: Path, monkeypatch: pytest.MonkeyPatch, outcomes: list[Any], *overrides: str
) -> tuple[RLTrainer, list[str]]:
    """A trainer whose spawns are stubs and whose attempts end as ``outcomes`` say (an
    exception to raise, or a value to return); the log records spawns, shutdowns and from
    where each attempt started."""
    events: list[str] = []

    def fake_spawn(*_: Any, **__: Any) -> _Groups:
        events.append("spawn")
        return _Groups(events)

    def fake_fit(self: RLTrainer) -> Any:
        events.append(f"attempt resume={self._resume_now} step={self.step}")
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            self.step = 5  # as if it failed mid-run
            raise outcome
        return outcome

    monkeypatch.setattr(run_loop, "spawn_roles", fake_spawn)  # the run loop spawns the groups
    monkeypatch.setattr(RLTrainer, "_fit", fake_fit)
    trainer = RLTrainer(_config(in_workdir / "runs" / "policy", *overrides))
    return trainer, events


def _lost() -> WorkerLostError:
    return WorkerLostError("actor", 1, "generate", "process died: killed")


def test_lost_workers_restart_up_to_max_restarts(
    in_workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, events = _policy_trainer(
        in_workdir, monkeypatch, [_lost(), _lost(), "done"], "run.max_restarts=2"
    )
    trainer._checkpoint_step = None  # no checkpoint yet: both restarts go back to step 0
    assert trainer._fit_with_restarts([]) == "done"
    assert events == ["spawn", "attempt resume=False step=0", "shutdown"] * 3
    assert len(trainer.restarts) == 2 and "rank 1" in trainer.restarts[0]

    trainer, events = _policy_trainer(in_workdir, monkeypatch, [_lost(), _lost(), "done"])
    trainer._checkpoint_step = 4  # a checkpoint of this run exists: resume from it
    with pytest.raises(WorkerLostError):
        trainer._fit_with_restarts([])  # max_restarts=1: the second loss is final
    assert events == [
        "spawn",
        "attempt resume=False step=0",
        "shutdown",
        "spawn",
        "attempt resume=True step=5",
        "shutdown",
    ]


@pytest.mark.parametrize(
    "error",
    [
        WorkerError("actor", 0, "update_actor", "ValueError", "bad shape", "tb"),
        ValueError("driver-side bug"),
        KeyboardInterrupt(),
    ],
    ids=["worker-exception", "driver-exception", "ctrl-c"],
)
def test_other_errors_are_not_retried(
    in_workdir: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    trainer, events = _policy_trainer(in_workdir, monkeypatch, [error, "done"])
    with pytest.raises(type(error)):
        trainer._fit_with_restarts([])
    assert events == ["spawn", "attempt resume=False step=0", "shutdown"]
    assert trainer.restarts == []


def test_an_out_of_memory_loss_is_not_restarted_and_says_what_to_lower(
    in_workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    oom = WorkerLostError("actor", 1, "update_actor", "killed (oom)", out_of_memory=True)
    trainer, events = _policy_trainer(in_workdir, monkeypatch, [oom, "done"], "run.max_restarts=2")
    trainer._last_metrics = {"memory/update_actor_peak_gib": 3.25}
    with pytest.raises(WorkerLostError) as info:
        trainer._fit_with_restarts([])
    assert events == ["spawn", "attempt resume=False step=0", "shutdown"]  # no restart
    assert trainer.restarts == [] and info.value.out_of_memory
    text = str(info.value)
    assert "out of memory in 'update_actor'" in text and "3.25 GiB" in text
    assert "Not restarted" in text and "actor.engine.micro_batch_size" in text


class CapMemoryAfterStep(threading.Thread):
    """Moves one worker into a memory cgroup with 1 MiB of room once metrics.jsonl reaches a
    step: the new pages its next stages touch meet the kernel's OOM killer, as a real run
    that outgrows its machine does."""

    def __init__(self, trainer: RLTrainer, step: int, cgroup: Path, rank: int = 1) -> None:
        super().__init__(daemon=True)
        self.trainer, self.step, self.cgroup, self.rank = trainer, step, cgroup, rank
        self.capped: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            roles = self.trainer.roles
            if roles is not None and logged_step_reached(self.trainer.output_dir, self.step):
                pid = roles.actor.pids[self.rank]
                # what it holds stays charged where it was: 1 MiB of new pages is the cap
                (self.cgroup / "memory.limit_in_bytes").write_text(str(2**20))
                (self.cgroup / "cgroup.procs").write_text(str(pid))
                self.capped = pid
                return


@pytest.fixture
def memory_cgroup() -> Any:
    root = Path("/sys/fs/cgroup/memory")
    if not os.access(root, os.W_OK):
        pytest.skip("no writable cgroup v1 memory hierarchy (needs root)")
    folder = root / f"hf-oom-test-{os.getpid()}"
    folder.mkdir()
    yield folder
    for _ in range(100):
        try:
            folder.rmdir()
            break
        except OSError:
            time.sleep(0.05)  # its last process is still exiting


@pytest.mark.usefixtures("ray_cluster")
def test_a_worker_killed_by_the_oom_killer_ends_the_run_as_out_of_memory(
    in_workdir: Path, memory_cgroup: Path
) -> None:
    trainer = RLTrainer(_config(in_workdir / "runs" / "oom", "run.max_restarts=2"))
    capper = CapMemoryAfterStep(trainer, 2, memory_cgroup)
    capper.start()
    try:
        with pytest.raises(WorkerLostError) as info:
            trainer.fit()
    finally:
        capper.stop.set()
    assert capper.capped is not None, "the worker was never capped"
    assert info.value.out_of_memory, info.value
    assert "out-of-memory killer" in str(info.value) and "Not restarted" in str(info.value)
    assert trainer.restarts == []  # the same step would have run out again


def test_time_based_checkpoints(in_workdir: Path) -> None:
    out = in_workdir / "runs" / "timed"
    trainer = RLTrainer(_config(out, "run.save_every=0", "run.save_every_minutes=0.5"))
    trainer.step = 3
    trainer._last_save = time.monotonic() - 29
    assert not trainer._save_due()
    trainer._last_save = time.monotonic() - 31
    assert trainer._save_due()
    off = RLTrainer(_config(out, "run.save_every=0", "run.save_every_minutes=null"))
    off._last_save = time.monotonic() - 1e6
    assert not off._save_due()
