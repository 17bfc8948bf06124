"""CPU ranks on one host that hand their work to the host's first rank, the leader (CPU only).

Why: on a CPU the ranks of one host share its cores and memory, so two processes that each
run half of a batch with one thread do the work of one process with two threads, plus what
splitting costs: each decode step and each forward reads every weight once per process, a
one-thread GEMM over half the rows runs slower than a two-thread GEMM over all of them, and
the ranks' collectives copy at memory speed on the same cores (docs/performance.md).  A rank
that hands its batch to the host's first rank and waits in a gloo receive (which takes no
CPU) lends that rank its core.  Generation (:mod:`hf_fsdp.cpu_leader_rollout`) and training
(:mod:`hf_fsdp.data_parallel.cpu_leader`) run on the leader this way where asked to; GPUs,
and groups that span hosts, never do.  (This was called "pooling" before "pool" came to mean a
resource pool alone: docs/glossary.md.)

Every rank of the group calls the same methods in the same order, as collectives require.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hf_core.batch import Batch
from hf_core.engines import torch_threads


def split_rows(whole: Batch, sizes: list[int]) -> list[Batch]:
    """``whole``'s rows back in consecutive pieces of ``sizes`` (the ranks' shares)."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(whole.index(slice(start, start + size)))
        start += size
    return pieces


def host_id() -> str:
    """This machine (host name and boot id: two containers with one name differ)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class LeaderGroup:
    """The default process group's ranks, all on this host; rank 0 computes for them all
    with :attr:`threads` threads (every rank's count, capped at the cores it may use).

    The leader takes that count for each call it leads only, not for good: work each rank
    does side by side between the calls (rewards, batch assembly) would otherwise run with
    the whole host's threads beside the other ranks' own, which made the two-process step
    slower (docs/performance.md, "Measured choices").
    """

    def __init__(self, threads: int) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.threads = threads

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def for_this_process(cls, device: torch.device) -> LeaderGroup | None:
        """The group, or None (a GPU, no process group, one rank, or ranks on several hosts).
        Collective over the default group."""
        if device.type != "cpu" or not dist.is_available() or not dist.is_initialized():
            return None
        if dist.get_world_size() < 2:
            return None
        seen: list[tuple[str, int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (host_id(), torch.get_num_threads()))
        if len({host for host, _ in seen}) != 1:  # type: ignore[misc]
            return None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        threads = sum(count for _, count in seen)  # type: ignore[misc]
        return cls(min(threads, cores) if cores else threads)

    def lead(self, value: Any, compute: Callable[[list[Any]], Any], *, scatter: bool) -> Any:
        """Every rank's ``value`` to the leader and ``compute(values)`` there with the group's
        threads; the result on every rank (``scatter``: a list, item ``rank`` to each rank).
        An exception on the leader raises on every rank, so none is left waiting."""
        gathered = self.gather(value)
        result: Any = None
        failure: Exception | None = None
        if gathered is not None:
            try:
                with torch_threads(self.threads):
                    result = compute(gathered)
            except Exception as exc:  # re-raised below, after the others are told
                failure = exc
        said = f"{type(failure).__name__}: {failure}" if failure is not None else ""
        if scatter:
            items = None
            if self.is_leader:
                items = (
                    [("ok", r) for r in result]
                    if failure is None
                    else [("error", said)] * self.world
                )
            status, payload = self.scatter(items)
        else:
            status, payload = self.broadcast(("ok", result) if failure is None else ("error", said))
        if failure is not None:
            raise failure
        if status == "error":
            raise RuntimeError(
                f"rank 0 failed on the work it leads for rank {self.rank}: {payload}"
            )
        return payload

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` in rank order on the leader; None elsewhere."""
        gathered: list[Any] | None = [None] * self.world if self.is_leader else None
        dist.gather_object(value, gathered, dst=0)
        return gathered

    def scatter(self, values: list[Any] | None) -> Any:
        """The leader's ``values[rank]`` on each rank (others pass None)."""
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, values if self.is_leader else None, src=0)
        return mine[0]

    def broadcast(self, value: Any) -> Any:
        """The leader's ``value`` on every rank."""
        box = [value if self.is_leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
