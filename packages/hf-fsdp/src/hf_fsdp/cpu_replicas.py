"""CPU ranks on one host train plain replicas of the model, without FSDP (CPU only).

Why: FSDP2 copies every parameter into a freshly allocated "gathered" buffer before each
unit's forward and backward, and after the backward concatenates the unit's gradients into
a flat buffer to reduce-scatter them.  On a CPU those copies run at memory speed on the
same cores that compute: one process at the Qwen2.5-0.5B shape spent ~4.8 s of a ~30 s
update in them with nothing to gather, and two processes on a 2-core VM spent ~5 s a step
in ``copy_`` / ``fill_`` / ``cat`` (docs/performance.md), which made two ranks slower than
one.  A replica per rank does none of that: each rank runs its micro-batches on its own
full copy, then the ranks average their gradients once per step through the shared-memory
file (:mod:`hf_fsdp.cpu_shared_memory`: a reduce-scatter and an all-gather, in place on
each gradient) and every rank takes the same optimizer step, so the replicas stay
bit-identical.  The weight sync then gathers nothing either: each rank exports its own copy.

The cost is memory: each rank holds the whole training state (weights, gradients, Adam's
two moments) instead of its share.  Replicas are used when the ranks' copies together take
at most :data:`REPLICA_MEMORY_SHARE` of the host's memory (always on one process, where
FSDP would hold the same), when every rank can map the shared file, and without mixed
precision (FSDP's policy is what casts the weights for compute).  Otherwise, and on GPUs
always, FSDP shards the model.

The plain module's parameters are ordinary tensors, which every path that reads them
already accepts: loading (a rank's slice is the whole tensor), export, checkpoints (DCP
saves replicated tensors once; a later run on more ranks or with FSDP loads its shards),
gradient clipping (a replicated gradient counts once in the global norm) and the offload
counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_core.engines.memory_fit import node_memory_bytes
from hf_fsdp.config import FSDPEngineConfig
from hf_fsdp.cpu_host import data_parallel_choice
from hf_fsdp.cpu_shared_memory import SharedMemoryExchange, exchange_for
from hf_fsdp.distributed import all_reduce_int
from hf_fsdp.loading import mixed_precision

REPLICA_MEMORY_SHARE = 0.25
"""Largest share of the host's memory the ranks' replicated training state may take."""


def training_state_bytes(cfg: FSDPEngineConfig, num_params: int, trainable: bool) -> int:
    """A whole model's weights, and when ``trainable`` its gradients and Adam moments."""
    copies = 4 if trainable else 1
    return copies * cfg.torch_param_dtype.itemsize * num_params


def replica_state_bytes(cfg: FSDPEngineConfig, num_params: int) -> int:
    """One replica's state: everything for full fine-tuning, the frozen weights for LoRA
    (its adapters' state is tiny)."""
    return training_state_bytes(cfg, num_params, cfg.trainable and cfg.lora is None)


def replicas_fit(
    cfg: FSDPEngineConfig,
    device: torch.device,
    num_params: int,
    ranks_on_host: int,
    host_bytes: int | None = None,
) -> bool:
    """Whether ``ranks_on_host`` CPU ranks train replicas (before the shared file is
    checked): the rule both the engine and the pre-start memory check apply."""
    if device.type != "cpu" or cfg.cpu_data_parallel == "fsdp":
        return False
    if mixed_precision(cfg, device) is not None:
        return False
    if ranks_on_host == 1:  # one process trains a plain model under pool too
        return True
    if data_parallel_choice(cfg.cpu_data_parallel, num_params) != "replicate":
        return False  # pooled instead (hf_fsdp.cpu_host_training)
    if cfg.cpu_collectives != "shared_memory":  # gloo would move every gradient over TCP
        return False
    total = host_bytes if host_bytes is not None else node_memory_bytes()
    return ranks_on_host * replica_state_bytes(cfg, num_params) <= REPLICA_MEMORY_SHARE * total


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


def choose_replicas(
    cfg: FSDPEngineConfig,
    device: torch.device,
    num_params: int,
    group: dist.ProcessGroup,
) -> tuple[bool, ReplicaGradients | None]:
    """``(replicated, gradient averaging)`` for this engine; every rank of ``group`` gets
    the same answer (the rule is agreed on before the shared file is tried)."""
    world = group.size()
    fits = replicas_fit(cfg, device, num_params, world)
    if world == 1:
        return fits, None
    if not all_reduce_int(int(fits), dist.ReduceOp.MIN):  # hosts may differ in memory
        return False, None
    exchange = exchange_for(group)
    if exchange is None:  # ranks on different hosts: FSDP
        return False, None
    return True, ReplicaGradients(exchange)
