"""CPU ranks on one host train plain replicas of the model, without FSDP (CPU only).

Why: FSDP2 copies every parameter into a freshly allocated "gathered" buffer before each unit's
forward and backward, and after the backward concatenates the unit's gradients into a flat
buffer to reduce-scatter them.  On a CPU those copies run at memory speed on the same cores that
compute, even with nothing to gather on one process; on two processes of a 2-core VM those
copies made two ranks slower than one (docs/performance.md, "Measured choices").  A replica per
rank does none of that: each rank runs its micro-batches on its own full copy, then the ranks
average their gradients once per step through the shared-memory file
(:mod:`hf_fsdp.cpu_shared_memory`: a reduce-scatter and an all-gather, in place on each
gradient) and every rank takes the same optimizer step, so the replicas stay bit-identical.  The
weight sync then gathers nothing either: each rank exports its own copy.

The cost is memory: each rank holds the whole training state (weights, gradients, Adam's
two moments) instead of its share.  Chosen with ``cpu_data_parallel: replicate`` where the
ranks' copies together take at most
:data:`~hf_fsdp.data_parallel.choice.REPLICA_MEMORY_SHARE` of the host's memory and every
rank maps the shared file (:mod:`hf_fsdp.data_parallel.choice`); one CPU process always
trains a plain module this way (nothing to exchange).  Otherwise FSDP2 shards.

The plain module's parameters are ordinary tensors, which every path that reads them
already accepts: loading (a rank's slice is the whole tensor), export, checkpoints (DCP
saves replicated tensors once; a later run on more ranks or with FSDP loads its shards),
gradient clipping (a replicated gradient counts once in the global norm) and the offload
counts.  Proven equal to FSDP2 on the same batch (loss, gradients, weights) by
``packages/hf-fsdp/tests/test_data_parallel_equality.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hf_fsdp.cpu_shared_memory import SharedMemoryExchange, exchange_for
from hf_fsdp.data_parallel.base import DataParallel
from hf_fsdp.data_parallel.choice import CPU_REPLICAS


class ReplicaGradients:
    """Averages the replicas' gradients in place through the shared file."""

    def __init__(self, exchange: SharedMemoryExchange) -> None:
        self.exchange = exchange

    @torch.no_grad()
    def average(self, params: list[torch.nn.Parameter]) -> None:
        """Every rank's gradients become the ranks' mean; the same parameters on every rank,
        in the same order (one without a gradient counts as zeros)."""
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            flat = grad.view(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
            self._all_reduce_mean(flat)
            if flat.data_ptr() != grad.data_ptr():
                grad.copy_(flat.view_as(grad))

    def _all_reduce_mean(self, flat: torch.Tensor) -> None:
        ex = self.exchange
        world, rank = ex.world, ex.rank
        bounds = [flat.numel() * r // world for r in range(world + 1)]
        chunks = [flat[bounds[r] : bounds[r + 1]] for r in range(world)]
        longest = max(c.numel() for c in chunks)
        others = [r for r in range(world) if r != rank]
        item = flat.element_size()
        # reduce-scatter: a slot carries one piece of every peer's chunk; each rank sums its own
        piece = max(1, ex.slot_bytes // (item * len(others)))
        for start in range(0, longest, piece):
            slots = [s.view(flat.dtype) for s in ex.next_slots()]
            for index, peer in enumerate(others):
                part = chunks[peer][start : start + piece]
                slots[rank][index * piece : index * piece + part.numel()].copy_(part)
            ex.barrier()
            mine = chunks[rank][start : start + piece]
            for peer in others:
                index = rank if rank < peer else rank - 1  # my place in the peer's list
                mine.add_(slots[peer][index * piece : index * piece + mine.numel()])
        chunks[rank].div_(world)
        # all-gather: each rank's averaged chunk to every peer
        piece = ex.slot_bytes // item
        for start in range(0, longest, piece):
            slots = [s.view(flat.dtype) for s in ex.next_slots()]
            part = chunks[rank][start : start + piece]
            slots[rank][: part.numel()].copy_(part)
            ex.barrier()
            for peer in others:
                target = chunks[peer][start : start + piece]
                target.copy_(slots[peer][: target.numel()])


class CPUReplicas(DataParallel):
    """A plain module per rank; after each backward the ranks average their gradients
    through the shared file and take the same optimizer step."""

    name = CPU_REPLICAS

    def __init__(self, rank: int, world: int, gradients: ReplicaGradients | None) -> None:
        super().__init__(rank, world)
        self.gradients = gradients
        if gradients is not None:
            self.collectives = "shared_memory"

    @classmethod
    def build(cls, group: dist.ProcessGroup) -> CPUReplicas | None:
        """Replicas over ``group``, or None where its ranks share no file (other hosts).
        Collective."""
        if group.size() == 1:
            return cls(0, 1, None)
        exchange = exchange_for(group)
        if exchange is None:
            return None
        return cls(group.rank(), group.size(), ReplicaGradients(exchange))

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        if self.gradients is not None:
            self.gradients.average(params)
