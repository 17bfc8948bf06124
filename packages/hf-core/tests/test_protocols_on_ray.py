"""Every transfer protocol driven through real Ray worker groups of 2 and 4 ranks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from hf_core.batch import Batch
from hf_core.runtime import ResourcePool, WorkerGroup, spawn

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _group(size: int) -> Iterator[WorkerGroup]:
    from workers_for_tests import ProbeWorker

    pool = ResourcePool([size], name=f"probe{size}")
    group = spawn(pool, {"probe": ProbeWorker})["probe"]
    yield group
    group.shutdown()
    pool.release()


@pytest.fixture(scope="module")
def group2(ray_cluster: None) -> Iterator[WorkerGroup]:
    yield from _group(2)


@pytest.fixture(scope="module")
def group4(ray_cluster: None) -> Iterator[WorkerGroup]:
    yield from _group(4)


def _batch(n: int) -> Batch:
    return Batch({"x": torch.arange(n) * 10})


def _two_dp_groups(tag: str) -> list[list[tuple[str, list[int]]]]:
    """What 4 ranks in two DP groups of 2 receive from ``_batch(4)``: each group its half."""
    return [[(tag, [0, 10])]] * 2 + [[(tag, [20, 30])]] * 2


def _received(group: WorkerGroup) -> list[list[tuple[str, object]]]:
    return group.take_received()


@pytest.mark.parametrize("size", [2, 4])
def test_torch_distributed_is_set_up(size: int, group2: WorkerGroup, group4: WorkerGroup) -> None:
    group = group2 if size == 2 else group4
    assert group.all_reduce_ranks() == [sum(range(size))] * size


@pytest.mark.parametrize("size", [2, 4])
def test_one_to_all(size: int, group2: WorkerGroup, group4: WorkerGroup) -> None:
    group = group2 if size == 2 else group4
    _received(group)
    assert group.one_to_all("hello") == [(r, "hello") for r in range(size)]
    assert _received(group) == [[("one_to_all", "hello")]] * size


@pytest.mark.parametrize("size", [2, 4])
def test_all_to_all(size: int, group2: WorkerGroup, group4: WorkerGroup) -> None:
    group = group2 if size == 2 else group4
    _received(group)
    values = [f"v{r}" for r in range(size)]
    assert group.all_to_all(values) == [(r, f"v{r}") for r in range(size)]
    assert _received(group) == [[("all_to_all", f"v{r}")] for r in range(size)]
    with pytest.raises(ValueError, match=f"ALL_TO_ALL expects a sequence of {size}"):
        group.all_to_all(values[:-1])


@pytest.mark.parametrize("size", [2, 4])
def test_rank_zero(size: int, group2: WorkerGroup, group4: WorkerGroup) -> None:
    group = group2 if size == 2 else group4
    _received(group)
    assert group.rank_zero(7) == (0, 7)
    assert _received(group) == [[("rank_zero", 7)]] + [[]] * (size - 1)


@pytest.mark.parametrize("size", [2, 4])
def test_dp_proto_splits_evenly_and_concatenates(
    size: int, group2: WorkerGroup, group4: WorkerGroup
) -> None:
    group = group2 if size == 2 else group4
    _received(group)
    out = group.dp(_batch(8))
    per_rank = 8 // size
    assert out["x"].tolist() == list(range(0, 80, 10))
    assert out["rank"].tolist() == [r for r in range(size) for _ in range(per_rank)]
    expected = [
        [("dp", [10 * i for i in range(r * per_rank, (r + 1) * per_rank)])] for r in range(size)
    ]
    assert _received(group) == expected


def test_dp_proto_pads_and_unpads(group4: WorkerGroup) -> None:
    _received(group4)
    out = group4.dp(_batch(6))  # padded to 8 by repeating samples 0 and 1
    assert out["x"].tolist() == [0, 10, 20, 30, 40, 50]
    assert _received(group4)[-1] == [("dp", [0, 10])]  # rank 3 got the padding


def test_3d_proto_on_tp2_dp2(group4: WorkerGroup) -> None:
    group4.configure_mesh(tp=2, pp=1)
    _received(group4)
    out = group4.three_d(_batch(4))
    # ranks (tp fastest): 0=(dp0,tp0) 1=(dp0,tp1) 2=(dp1,tp0) 3=(dp1,tp1)
    assert _received(group4) == _two_dp_groups("3d")
    assert out["x"].tolist() == [0, 10, 20, 30]
    assert out["rank"].tolist() == [0, 0, 2, 2]  # collected from TP rank 0 of each DP group


def test_3d_proto_on_pp2_dp2(group4: WorkerGroup) -> None:
    group4.configure_mesh(tp=1, pp=2)
    _received(group4)
    out = group4.three_d(_batch(4))
    # ranks: 0=(dp0,pp0) 1=(dp0,pp1) 2=(dp1,pp0) 3=(dp1,pp1)
    assert _received(group4) == _two_dp_groups("3d")
    assert out["rank"].tolist() == [1, 1, 3, 3]  # collected from the last pipeline stage


def test_3d_proto_on_tp2_pp2(group4: WorkerGroup) -> None:
    group4.configure_mesh(tp=2, pp=2)
    _received(group4)
    out = group4.three_d(_batch(2))
    assert _received(group4) == [[("3d", [0, 10])]] * 4  # a single DP group gets everything
    assert out["rank"].tolist() == [2, 2]  # tp rank 0 on pp stage 1


def test_3d_pp_only(group4: WorkerGroup) -> None:
    group4.configure_mesh(tp=1, pp=2)
    _received(group4)
    assert group4.pp_only("w") == [(0, 0, "w"), (1, 1, "w")]
    assert _received(group4) == [[("pp_only", "w")]] * 4
    group4.configure_mesh(tp=2, pp=2)
    assert group4.pp_only("w") == [(0, 0, "w"), (2, 1, "w")]


def test_3d_all_micro_dp_generation_tp2(group4: WorkerGroup) -> None:
    # training tp=2, dp=2; generation t_g=2: one generation replica per DP group
    group4.configure_mesh(tp=2, pp=1, gen_tp=2)
    _received(group4)
    out = group4.micro_dp(_batch(4))
    assert _received(group4) == _two_dp_groups("micro_dp")
    assert out["rank"].tolist() == [0, 0, 2, 2]


def test_3d_all_micro_dp_generation_tp1(group4: WorkerGroup) -> None:
    # training tp=2, dp=2; generation t_g=1: micro-DP 2, so four generation replicas
    group4.configure_mesh(tp=2, pp=1, gen_tp=1)
    _received(group4)
    out = group4.micro_dp(_batch(8))
    assert _received(group4) == [[("micro_dp", [20 * r, 20 * r + 10])] for r in range(4)]
    assert out["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_future_passes_between_groups_without_the_driver(
    group2: WorkerGroup, group4: WorkerGroup
) -> None:
    group4.configure_mesh(tp=1, pp=1)  # plain DP over 4 ranks
    source = group4.dp_async(_batch(8))  # non-blocking method: a future
    _received(group2)
    out = group2.dp(group4.dp.remote(_batch(4)))  # 4 chunks vs 2 ranks: goes via the driver
    assert out["x"].tolist() == [0, 10, 20, 30]
    assert group4.dp.remote(_batch(4)).chunk_refs(2, True) is None
    four = group4.dp(source)  # same chunking: chunk refs pass straight through
    assert not source.resolved
    assert four["x"].tolist() == list(range(0, 80, 10))
    assert four["rank"].tolist() == [r for r in range(4) for _ in range(2)]


def test_non_blocking_calls_on_two_groups_overlap(group2: WorkerGroup, group4: WorkerGroup) -> None:
    first = group2.sleep_interval(1.0)
    second = group4.sleep_interval(1.0)
    intervals = first.result() + second.result()
    latest_start = max(start for start, _ in intervals)
    earliest_end = min(end for _, end in intervals)
    assert latest_start < earliest_end  # every rank of both groups was running at once


def test_worker_processes_start_with_the_process_environment(
    group2: WorkerGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set by Ray before the interpreter starts (torch reads it at its first allocation); a
    value the driver sets itself is left alone."""
    from hf_core.runtime.process_env import WORKER_DEFAULTS, worker_process_env

    for name, value in WORKER_DEFAULTS.items():
        assert group2.environment([name] * 2) == [os.environ.get(name, value)] * 2
        monkeypatch.delenv(name, raising=False)
        assert worker_process_env()[name] == value
        monkeypatch.setenv(name, "0")
        assert name not in worker_process_env()
