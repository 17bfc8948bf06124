"""Colocated roles share a process; split roles do not."""

from __future__ import annotations

import pytest

from hf_core.runtime import ResourcePool, spawn

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_colocated_roles_share_process_and_memory() -> None:
    from workers_for_tests import HolderWorker, ReaderWorker

    pool = ResourcePool([2], name="colocated")
    groups = spawn(pool, {"holder": HolderWorker, "reader": ReaderWorker})
    holder, reader = groups["holder"], groups["reader"]
    try:
        assert holder.pids == reader.pids
        filled = holder.fill(3.5)  # each role is called as its own group
        seen = reader.read_holder()
        for (pid, ptr), (reader_pid, reader_ptr, values) in zip(filled, seen, strict=True):
            assert reader_pid == pid
            assert reader_ptr == ptr  # the very same tensor storage
            assert values == [3.5] * 4
        assert len({pid for pid, _ in filled}) == 2  # one process per rank
    finally:
        holder.shutdown()
        pool.release()


def test_split_roles_live_in_separate_processes() -> None:
    from workers_for_tests import HolderWorker, ReaderWorker

    pools = ResourcePool([1], name="split_a"), ResourcePool([2], name="split_b")
    holder = spawn(pools[0], {"holder": HolderWorker})["holder"]
    reader = spawn(pools[1], {"reader": ReaderWorker})["reader"]
    try:
        assert holder.world_size == 1 and reader.world_size == 2
        assert not set(holder.pids) & set(reader.pids)
        with pytest.raises(Exception, match="role 'holder' is not colocated with 'reader'"):
            reader.read_holder()
    finally:
        holder.shutdown()
        reader.shutdown()
        for pool in pools:
            pool.release()


def test_two_groups_can_share_bundles_in_separate_processes() -> None:
    from workers_for_tests import HolderWorker, ReaderWorker

    pool = ResourcePool([2], name="shared", max_colocate=2)
    holder = spawn(pool, {"holder": HolderWorker})["holder"]
    reader = spawn(pool, {"reader": ReaderWorker})["reader"]
    try:
        assert not set(holder.pids) & set(reader.pids)
        assert reader.pid() == reader.pids
    finally:
        holder.shutdown()
        reader.shutdown()
        pool.release()


def test_use_gpu_auto_follows_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cluster.use_gpu: auto`` asks for GPUs exactly when Ray reports some (a worker that
    asks for none has its GPUs hidden by Ray and would train on the CPU)."""
    from hf_core.runtime import cluster

    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert cluster.resolve_use_gpu("auto") is False
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    assert cluster.resolve_use_gpu("auto") is True
    assert cluster.resolve_use_gpu(False) is False
    assert cluster.resolve_use_gpu(True) is True
