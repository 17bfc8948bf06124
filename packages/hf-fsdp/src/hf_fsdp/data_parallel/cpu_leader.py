"""CPU ranks on one host train one model: the weights in one shared file, the whole update
(forwards, backwards, optimizer) on the host's first rank with every rank's threads (CPU only).

Why: FSDP shards make each rank gather every weight before using it and reduce every
gradient after, copies that on a CPU run at memory speed on the cores that compute;
replicas (:mod:`hf_fsdp.data_parallel.cpu_replicas`) avoid the copies but hold the whole
training state once per rank (two Qwen2.5-0.5B-shape replicas take two thirds of a 24 GB
host); and either way each rank computes its half of the batch with its own threads, which
on one host's shared cores is slower than one process computing all of it
(docs/performance.md).  Here the host trains as one process would:

- rank 0 runs the forwards and backwards of every rank's batch, and the optimizer step, with
  every rank's threads (:class:`~hf_fsdp.cpu_leader.LeaderGroup`; the others wait in a gloo
  receive, which takes no CPU).  Its weights, gradients and Adam moments are its own
  private tensors, as in one process;
- the other ranks hold no training state, only a mirror of the weights in a ``/dev/shm``
  file, which rank 0 brings up to date (one copy) before they read it for a weight sync, an
  export or a checkpoint -- no gathers.

Why rank 0 keeps its own weights rather than computing on the shared ones: a shared file
sits on 4 KiB pages (tmpfs does not take transparent huge pages unless the host's
``shmem_enabled`` allows it), and GEMMs streaming large weights from them ran markedly
slower than from private huge pages.  An earlier version computed
on the shared weights with the gradients bound in the same file and the optimizer split
over the ranks; it paid that, plus autograd adding into the bound gradients and their
zeroing, and ran slower than one process (docs/performance.md, "Measured choices").

The arithmetic is the data-parallel step's.  The ranks' batches, joined in rank order, are
trained as one process would train the global batch (the gradient data parallelism averages
to); where their widths differ, each rank's micro-batches are planned and scaled as that rank
would and the summed gradient is divided by the rank count, as FSDP's reduce-scatter
averages.  Chosen with ``cpu_data_parallel: leader`` (:mod:`hf_fsdp.data_parallel.choice`):
no mixed precision, no sequence parallelism, every rank on one host and able to map the
file; otherwise, and on GPUs always, FSDP2 shards.  Proven equal to FSDP2 on the same batch
(loss, gradients, weights) by ``packages/hf-fsdp/tests/test_data_parallel_equality.py``.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from hf_core.batch import Batch, BatchError
from hf_fsdp.cpu_leader import LeaderGroup, split_rows
from hf_fsdp.cpu_shared_memory import map_shared_file
from hf_fsdp.data_parallel.base import (
    DataParallel,
    Forward,
    Share,
    ThisProcess,
    Update,
    UpdateResult,
)
from hf_fsdp.data_parallel.choice import CPU_LEADER

log = logging.getLogger(__name__)

_ALIGN = 64
"""Each tensor's offset in the shared file (bytes): whole cache lines, any dtype's alignment."""


def _nbytes(param: nn.Parameter) -> int:
    return param.numel() * param.element_size()


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def joined(parts: list[Batch]) -> Batch | None:
    """The ranks' batches as one, rows in rank order, or None where their keys or widths
    differ (a trainer's batch split over the ranks has one width)."""
    try:
        return Batch.concat(parts)
    except (BatchError, RuntimeError):
        return None


def _mirror_bytes(model: nn.Module) -> int:
    """The shared file's size: every weight, each at an aligned offset."""
    return sum(_aligned(_nbytes(p)) for p in model.parameters())


class CPULeader(DataParallel):
    """One model trained on the host's first rank, in its own memory; the other ranks read
    a mirror of its weights in a shared file, brought up to date before they read it."""

    name = CPU_LEADER

    def __init__(self, ranks: LeaderGroup, buffer: torch.Tensor) -> None:
        super().__init__(ranks.rank, ranks.world)
        self.ranks = ranks
        self.buffer = buffer
        self.collectives = "shared_memory"
        # the first rank holds the whole state and is the only one that grows while it
        # updates (the others wait): budgeting it a rank's share of the node turned
        # recomputation on at the 0.5B shape on two processes (bench/RESULTS.md)
        self.growing_processes = 1
        self.holds_optimizer = ranks.is_leader
        self._mirrored: list[tuple[torch.Tensor, torch.Tensor]] = []
        """The leader's (weight, its view in the shared file) pairs (set by :meth:`loaded`)."""
        self._stale = False

    @classmethod
    def build(
        cls, model: nn.Module, device: torch.device, group: dist.ProcessGroup
    ) -> CPULeader | None:
        """Training on the leader for ``model`` (its parameters may still be on the meta device),
        or None where the hosts or ``/dev/shm`` rule it out.  Collective."""
        ranks = LeaderGroup.for_this_process(device)
        if ranks is None:
            return None
        size = _mirror_bytes(model)
        buffer = map_shared_file(group, size)
        if buffer is None:
            log.info(
                "training on the leader needs a %d MiB /dev/shm file every rank maps (twice that "
                "free): FSDP shards instead",
                size >> 20,
            )
            return None
        log.info(
            "%d ranks train one model on rank 0 with %d threads (the others read a %d MiB "
            "mirror of its weights in /dev/shm)",
            ranks.world,
            ranks.threads,
            size >> 20,
        )
        return cls(ranks, buffer)

    @torch.no_grad()
    def loaded(self, model: nn.Module) -> None:
        """Copy the loaded weights into the mirror (rank 0's; every rank loaded the same)
        and point the other ranks' parameters at it.  Collective."""
        params = list(model.parameters())
        if _mirror_bytes(model) > self.buffer.numel():
            raise RuntimeError("the loaded model outgrew the shared file planned for it")
        offset = 0
        views: list[torch.Tensor] = []
        for param in params:
            nbytes = _nbytes(param)
            views.append(self.buffer[offset : offset + nbytes].view(param.dtype).view(param.shape))
            offset += _aligned(nbytes)
        if self.ranks.is_leader:
            self._mirrored = [(param.data, view) for param, view in zip(params, views, strict=True)]
            self._stale = True
            self.publish()
        else:
            self.ranks.broadcast(None)  # the leader's publish
            for param, view in zip(params, views, strict=True):
                param.data = view

    def forward(self, batch: Batch, forward: Forward) -> Batch:
        """Every rank's batch through the host's first rank: joined when they have one
        width, else each as that rank would run it."""

        def forward_all(parts: list[Batch]) -> list[Batch]:
            whole = joined(parts)
            if whole is None:
                return forward(parts, ThisProcess())
            return split_rows(forward([whole], ThisProcess())[0], [len(p) for p in parts])

        mine: Batch = self.ranks.lead(batch, forward_all, scatter=True)
        return mine

    def train(self, batch: Batch, update: Update) -> UpdateResult:
        """The whole update on the host's first rank: the ranks' batches joined as one
        process trains the global batch, else each rank's share as that rank would (the
        summed gradient divided by the rank count, as FSDP's reduce-scatter averages)."""

        def update_all(parts: list[Batch]) -> UpdateResult:
            whole = joined(parts)
            shares = (
                [Share(whole, 0, 1)]
                if whole is not None
                else [Share(part, rank, len(parts)) for rank, part in enumerate(parts)]
            )
            return update(shares, ThisProcess())

        result: UpdateResult = self.ranks.lead(batch, update_all, scatter=False)
        self._stale = True  # the leader stepped the weights: the mirror is behind
        return result

    @torch.no_grad()
    def publish(self) -> None:
        """Bring the mirror up to date before the other ranks read it (a weight sync, an
        export, a checkpoint).  Collective; nothing happens when no step came since."""
        if not self._stale:
            return
        for weight, view in self._mirrored:
            view.copy_(weight)
        self.ranks.broadcast(None)  # the mirror is whole before anyone reads it
        self._stale = False
