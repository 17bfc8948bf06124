"""FSDP's shared-memory collectives (hf_fsdp.cpu_shared_memory) against gloo's, on real
processes: the same bytes for every size, dtype and rank count, tensors far larger than a
slot, the file gone once mapped, gloo kept when a rank cannot map it, and a dead peer failing
the call instead of hanging it.  The replicas' gradient average
(hf_fsdp.data_parallel.cpu_replicas) over the same file: gloo's mean, and the same bytes on
every rank.  The leader group (hf_fsdp.cpu_leader)
that leader generation and training share: a failure on its computing rank raises on every
rank."""

from __future__ import annotations

import glob
import os
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SMALL_BUDGET = 64 * 1024  # a few KiB a slot: every tensor below goes through in many pieces


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))


def _exchange(budget: int) -> Any:
    from hf_fsdp import cpu_shared_memory as shm

    exchange = shm.exchange_for(dist.group.WORLD, file_bytes=budget)
    assert exchange is not None
    return shm, exchange


def _matches_gloo(rank: int, world: int) -> tuple[int, list[str], int]:
    before = set(glob.glob("/dev/shm/hybridflow-fsdp-*"))
    shm, exchange = _exchange(SMALL_BUDGET)
    dist.barrier()
    leftover = set(glob.glob("/dev/shm/hybridflow-fsdp-*")) - before
    gather, scatter = shm.SharedMemoryAllGather(exchange), shm.SharedMemoryReduceScatter(exchange)
    group = dist.group.WORLD
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for numel in (1, 1000, 12_345, 40_000):  # 40,000 float32: ~15 slot pieces
            gen = torch.Generator().manual_seed(1000 * rank + numel)
            shard = (torch.randn(numel, generator=gen) * 100).to(dtype)
            ours = gather.allocate((numel * world,), dtype=dtype, device=torch.device("cpu"))
            ours[rank * numel : (rank + 1) * numel] = shard  # as FSDP's copy-in leaves it
            assert gather(ours, ours[rank * numel : (rank + 1) * numel], group) is None
            theirs = torch.empty(numel * world, dtype=dtype)
            dist.all_gather_into_tensor(theirs, shard)
            assert torch.equal(ours, theirs), (dtype, numel)
            if dtype == torch.int64:
                continue
            full = (torch.randn(numel * world, generator=gen) * 10).to(dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                out = scatter.allocate((numel,), dtype=dtype, device=torch.device("cpu"))
                scatter(out, full, group, op)
                summed = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(summed, full.clone(), op=dist.ReduceOp.SUM)
                if op == dist.ReduceOp.AVG:
                    summed = summed / world
                # two summands add the same way in any order; more may round differently
                exact = world == 2 and op == dist.ReduceOp.SUM
                tolerance = 0.0 if exact else 1e-5 if dtype == torch.float32 else 2e-2
                error = (out.float() - summed.float()).abs().max().item()
                assert error <= tolerance * (1 + summed.float().abs().max().item()), (
                    dtype,
                    numel,
                    op,
                    error,
                )
            checked += 1
    return checked, sorted(leftover), exchange.calls


def _replica_average(rank: int, world: int) -> tuple[float, str]:
    """Gradients of odd sizes (larger than a slot, smaller than the rank count, a transposed
    one, one missing) averaged through the file, against gloo's all-reduce."""
    import hashlib

    from hf_fsdp.data_parallel.cpu_replicas import ReplicaGradients

    _, exchange = _exchange(SMALL_BUDGET)
    shapes = [(1,), (2,), (40_000,), (333, 7), (7, 333), (5,)]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    gen = torch.Generator().manual_seed(rank)
    for index, param in enumerate(params[:-1]):  # the last has no gradient on any rank
        grad = torch.randn(param.shape, generator=gen) * (rank + 1)
        param.grad = grad.t().contiguous().t() if index == 4 else grad  # 4: not contiguous
    expected = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for tensor in expected:
        dist.all_reduce(tensor)
        tensor /= world
    ReplicaGradients(exchange).average(params)
    error = max(float((p.grad - e).abs().max()) for p, e in zip(params, expected, strict=True))
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.grad.contiguous().view(-1).view(torch.uint8).numpy())
    return error, digest.hexdigest()


def _fallback(rank: int) -> tuple[bool, Any]:
    """On a fresh group, as if rank 1 lived on another host: the file is not there."""
    from hf_fsdp import cpu_shared_memory as shm

    group = dist.new_group([0, 1])
    real = torch.from_file
    if rank == 1:

        def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise RuntimeError("no such file")

        torch.from_file = refuse  # type: ignore[assignment]
    try:
        return shm.attach(torch.nn.Linear(4, 4), group), shm.exchange_for(group)
    finally:
        torch.from_file = real  # type: ignore[assignment]


def _leader_failure(rank: int) -> tuple[Any, str]:
    """The leader group (hf_fsdp.cpu_leader) hands each rank its item, then the leader's compute
    raises: every rank raises, none is left waiting."""
    from hf_fsdp.cpu_leader import LeaderGroup

    ranks = LeaderGroup(threads=1)
    items = ranks.lead(10 * rank, lambda values: [v + 1 for v in values], scatter=True)

    def broken(values: list[Any]) -> Any:
        raise ValueError("a bad batch")

    try:
        ranks.lead(rank, broken, scatter=False)
        return items, "returned"
    except Exception as error:
        return items, f"{type(error).__name__}: {error}"


def _dead_peer(rank: int) -> str:
    """Rank 1 dies before the collective that rank 0 waits in."""
    shm, exchange = _exchange(SMALL_BUDGET)
    if rank == 1:
        os._exit(0)
    out = torch.empty(2000)
    try:
        shm.SharedMemoryAllGather(exchange)(out, out[:1000], dist.group.WORLD)
        return "returned"
    except Exception as error:  # gloo reports the closed connection
        return type(error).__name__


def _sized_file(rank: int) -> tuple[int, int, int]:
    """A model of two FSDP units (a 300 x 50 layer inside, a 7 x 10 + 7 root) attached on a
    fresh group: the file it maps, the largest shard by hand, and the capped size for a big
    model."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from hf_fsdp import cpu_shared_memory as shm

    group = dist.new_group([0, 1])
    mesh = DeviceMesh.from_group(group, device_type="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(50, 300, bias=False), torch.nn.Linear(10, 7))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert shm.attach(model, group)
    exchange = shm.exchange_for(group)
    assert exchange is not None
    with torch.device("meta"):  # shapes only
        big = torch.nn.Linear(8192, 8192, bias=False)  # 256 MiB of float32
    fully_shard(big, mesh=mesh)
    return exchange.buffer.numel(), 150 * 50 * 4, shm.exchange_file_bytes(big, 2)


def _run(rank: int, world: int, port: int, result: Any) -> None:
    _init(rank, world, port)
    result[("matches", rank)] = _matches_gloo(rank, world)
    result[("replicas", rank)] = _replica_average(rank, world)
    if world == 2:
        result[("fallback", rank)] = _fallback(rank)
        result[("sized", rank)] = _sized_file(rank)
        result[("leader_failure", rank)] = _leader_failure(rank)
        result[("dead_peer", rank)] = _dead_peer(rank)


def _spawn(world: int) -> dict:
    """One set of processes per rank count runs every check (importing torch's distributed
    packages is most of a spawn's cost)."""
    result = mp.Manager().dict()
    mp.spawn(_run, args=(world, _free_port(), result), nprocs=world)
    return dict(result)


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return _spawn(2)


def _assert_matches(world: int, result: dict) -> None:
    for rank in range(world):
        checked, leftover, calls = result[("matches", rank)]
        assert checked == 8  # 2 float dtypes x 4 sizes, all-gather and both reduce ops
        assert leftover == []  # unlinked as soon as every rank mapped it
        assert calls > 3 * 8  # large tensors really went through in several slot pieces


def test_collectives_match_gloo_byte_for_byte(two_ranks: dict) -> None:
    _assert_matches(2, two_ranks)


def _assert_replicas_agree(world: int, result: dict) -> None:
    errors, digests = zip(*(result[("replicas", rank)] for rank in range(world)), strict=True)
    assert max(errors) < 1e-5  # gloo's mean, up to the order of the additions
    assert len(set(digests)) == 1  # every replica holds the same bytes


def test_replica_gradients_average_like_gloo_and_agree_to_the_bit(two_ranks: dict) -> None:
    _assert_replicas_agree(2, two_ranks)


def test_three_ranks_reduce_each_peer_chunk_in_its_place() -> None:
    result = _spawn(3)
    _assert_matches(3, result)
    _assert_replicas_agree(3, result)


def test_a_rank_that_cannot_map_the_file_keeps_every_rank_on_gloo(two_ranks: dict) -> None:
    assert two_ranks[("fallback", 0)] == (False, None)
    assert two_ranks[("fallback", 1)] == (False, None)


def test_the_file_is_sized_to_the_largest_unit_shard_and_capped(two_ranks: dict) -> None:
    from hf_fsdp.config import SHARED_MEMORY_FILE_BYTES

    for rank in range(2):
        mapped, largest_shard, big = two_ranks[("sized", rank)]
        slot = -(-largest_shard // 4096) * 4096  # one page-aligned shard a slot, 2 sets x 2 ranks
        assert mapped == 2 * 2 * slot < SHARED_MEMORY_FILE_BYTES
        assert big == SHARED_MEMORY_FILE_BYTES  # a 128 MiB shard goes through in pieces


def test_a_failure_on_the_leader_raises_on_every_rank(two_ranks: dict) -> None:
    assert two_ranks[("leader_failure", 0)] == (1, "ValueError: a bad batch")
    items, said = two_ranks[("leader_failure", 1)]
    assert items == 11  # its own item of the leader's list
    assert said.startswith("RuntimeError: rank 0 failed") and "ValueError: a bad batch" in said


def test_a_dead_peer_fails_the_collective_instead_of_hanging(two_ranks: dict) -> None:
    assert two_ranks[("dead_peer", 0)] not in (None, "returned")  # an error, within gloo's 30 s
