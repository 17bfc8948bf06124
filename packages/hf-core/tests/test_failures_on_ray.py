"""Failures inside worker groups reach the controller as errors, never as hangs."""

from __future__ import annotations

import time

import pytest

from hf_core.runtime import (
    GroupBrokenError,
    ResourcePool,
    RoleSpec,
    WorkerError,
    WorkerLostError,
    spawn,
)

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _probe_group(name: str, failure_timeout_s: float = 30.0):
    from workers_for_tests import ProbeWorker

    pool = ResourcePool([2], name=name)
    return pool, spawn(pool, {"prober": ProbeWorker}, failure_timeout_s=failure_timeout_s)["prober"]


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


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_lost_worker_is_reported_within_the_bound(how: str) -> None:
    bound = 4.0
    pool, group = _probe_group(f"lost-{how}", failure_timeout_s=bound)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            group.die_on(rank=1, how=how)  # rank 0 sleeps as if blocked in a collective
        elapsed = time.monotonic() - start
        assert (info.value.role, info.value.rank, info.value.method) == ("prober", 1, "die_on")
        # SIGKILL is seen when the process exits; SIGSTOP only by missed heartbeats.
        assert elapsed < bound + 10.0, f"took {elapsed:.1f} s"  # vs 120 s of sleeping peers
        with pytest.raises(GroupBrokenError):
            group.one_to_all("still there?")
    finally:
        group.shutdown()
        pool.release()
