"""Failures inside worker groups reach the controller as errors, never as hangs."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_core.protocols import register
from hf_core.runtime import (
    GroupBrokenError,
    ResourcePool,
    RoleSpec,
    WorkerError,
    WorkerLostError,
    spawn,
)
from hf_core.worker import Worker

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _probe_group(name: str, failure_timeout_s: float = 30.0, stacks_dir: Path | None = None):
    from workers_for_tests import ProbeWorker

    pool = ResourcePool([2], name=name)
    groups = spawn(
        pool,
        {"prober": ProbeWorker},
        failure_timeout_s=failure_timeout_s,
        stacks_dir=str(stacks_dir) if stacks_dir else None,
    )
    return pool, groups["prober"]


def test_exception_names_role_rank_method_and_carries_remote_traceback() -> None:
    pool, group = _probe_group("raise")
    try:
        assert group.fail_on(rank=-1) == [0, 1]
        with pytest.raises(WorkerError) as info:
            group.fail_on(rank=1)
        error = info.value
        assert (error.role, error.rank, error.method) == ("prober", 1, "fail_on")
        assert error.exc_type == "ValueError"
        assert "boom on purpose at rank 1" in str(error)
        assert "workers_for_tests.py" in error.remote_traceback
        assert "in fail_on" in error.remote_traceback
        assert group.fail_on(rank=-1) == [0, 1]  # a raised error leaves the group usable
    finally:
        group.shutdown()
        pool.release()


def test_constructor_failure_names_role_and_rank() -> None:
    from workers_for_tests import ProbeWorker

    pool = ResourcePool([2], name="badinit")
    try:
        with pytest.raises(WorkerError, match=r"role 'broken' rank [01] method '__init__'") as info:
            spawn(pool, {"broken": RoleSpec(ProbeWorker, kwargs={"no_such_arg": 1})})
        assert "no_such_arg" in str(info.value)
    finally:
        pool.release()


def test_error_while_peers_wait_in_a_collective_breaks_the_group() -> None:
    bound = 3.0
    pool, group = _probe_group("stuck", failure_timeout_s=bound)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError, match="fails before the all-reduce") as info:
            group.fail_before_collective(rank=1)
        assert info.value.rank == 1
        assert time.monotonic() - start < bound + 5.0
        start = time.monotonic()
        with pytest.raises(GroupBrokenError, match="blocked in a collective"):
            group.one_to_all("anyone?")  # would queue behind rank 0 forever
        assert time.monotonic() - start < 1.0
    finally:
        group.shutdown()
        pool.release()


def test_a_dead_engine_loses_its_worker_so_the_trainer_replaces_it(tmp_path: Path) -> None:
    pool, group = _probe_group("engine-died", stacks_dir=tmp_path)
    try:
        with pytest.raises(WorkerLostError) as info:
            group.engine_dies_on(rank=1)
        lost = info.value
        assert (lost.role, lost.rank, lost.method) == ("prober", 1, "engine_dies_on")
        assert lost.reason.startswith("engine died: the engine of rank 1 failed on purpose")
        assert not lost.out_of_memory
        assert lost.stacks_dir == str(tmp_path)  # every rank's stacks, as for a lost process
        with pytest.raises(GroupBrokenError, match="lost its engine"):
            group.fail_on(rank=-1)
    finally:
        group.shutdown()
        pool.release()


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_lost_worker_is_reported_within_the_bound(how: str, tmp_path: Path) -> None:
    bound = 4.0
    pool, group = _probe_group(f"lost-{how}", failure_timeout_s=bound, stacks_dir=tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            group.die_on(rank=1, how=how)  # rank 0 sleeps as if blocked in a collective
        elapsed = time.monotonic() - start
        assert (info.value.role, info.value.rank, info.value.method) == ("prober", 1, "die_on")
        # SIGKILL is seen when the process exits; SIGSTOP only by missed heartbeats.
        assert elapsed < bound + 10.0, f"took {elapsed:.1f} s"  # vs 120 s of sleeping peers
        assert info.value.stacks_dir == str(tmp_path)
        (survivor,) = tmp_path.glob("*_rank0.txt")  # the survivor shows where it waits
        assert "in die_on" in survivor.read_text()
        with pytest.raises(GroupBrokenError):
            group.one_to_all("still there?")
    finally:
        group.shutdown()
        pool.release()


def _sleep_holding_the_gil(seconds: int) -> None:
    """A C call that never releases the GIL: the control thread cannot answer heartbeats,
    as with a deadlock inside a C extension."""
    ctypes.PyDLL(None).sleep(seconds)


class FrozenWorker(Worker):
    """Imported by the worker processes from this module (the tests folder is on their path)."""

    @register("ONE_TO_ALL")
    def freeze_in_c(self, rank: int) -> int:
        """``rank`` freezes holding the GIL; the others block in an all-reduce it never joins."""
        if self.rank == rank:
            _sleep_holding_the_gil(600)
        value = torch.ones(1)
        dist.all_reduce(value)
        return int(value.item())


def test_frozen_worker_is_reported_with_every_ranks_stacks(tmp_path: Path) -> None:
    bound = 5.0
    stacks = tmp_path / "stacks"
    pool = ResourcePool([2], name="frozen")
    group = spawn(pool, {"frozen": FrozenWorker}, failure_timeout_s=bound, stacks_dir=str(stacks))[
        "frozen"
    ]
    try:
        assert group.freeze_in_c(rank=-1) == [2, 2]  # a healthy call disarms the watchdog:
        time.sleep(bound)  # nothing is dumped after it returned
        assert not [p for p in stacks.glob("*") if p.stat().st_size], "a healthy call dumped"
        start = time.monotonic()
        with pytest.raises(WorkerLostError, match="no sign of life") as info:
            group.freeze_in_c(rank=1)
        elapsed = time.monotonic() - start
        assert info.value.rank == 1
        assert elapsed < bound + 8.0, f"took {elapsed:.1f} s"  # heartbeat period + dump requests
        assert info.value.stacks_dir == str(stacks)
        assert str(stacks) in str(info.value)
        frozen, waiting = sorted(stacks.glob("*_rank1.txt")), sorted(stacks.glob("*_rank0.txt"))
        assert len(frozen) == 1 and len(waiting) == 1, sorted(stacks.iterdir())
        frozen_text, waiting_text = frozen[0].read_text(), waiting[0].read_text()
        # The frozen rank's own watchdog (a C thread) wrote its stacks: it could not answer.
        assert "Timeout" in frozen_text and "_sleep_holding_the_gil" in frozen_text
        # The survivor dumped on the controller's request: it waits in the collective.
        assert "rank 1 (frozen) lost" in waiting_text
        assert "freeze_in_c" in waiting_text and "all_reduce" in waiting_text
    finally:
        group.shutdown()
        pool.release()
