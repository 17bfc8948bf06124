"""CPU ranks on one host train one model: weights and gradients in one shared file, the
forward and backward passes pooled on the host's first rank, the optimizer split (CPU only).

Why: FSDP shards make each rank gather every weight before using it and reduce every
gradient after, copies that on a CPU run at memory speed on the cores that compute; replicas
(:mod:`hf_fsdp.cpu_replicas`) avoid the copies but hold the whole training state once per
rank (two Qwen2.5-0.5B-shape replicas take two thirds of a 24 GB host); and either way each
rank computes its half of the batch with its own threads, which on one host's shared cores is
slower than one process computing all of it (docs/performance.md).  Here the host holds one
copy of the weights and one of the gradients, mapped by every rank from a ``/dev/shm`` file:

- forwards and backwards run on rank 0 for every rank's batch, with every rank's threads
  (:class:`~hf_fsdp.cpu_host.HostPool`; the others wait in a gloo receive);
- each rank's optimizer steps a contiguous share of the trainable parameters, about
  ``1 / world`` of their bytes, in place in the shared weights, all ranks at once; Adam's
  moments are split the same way, so the host holds the training state of one process;
- every rank reads the same weights for its weight sync, export and checkpoint (DCP saves a
  replicated tensor once; each rank's optimizer saves the moments of its share).

The arithmetic is the data-parallel step's.  The ranks' batches, joined in rank order, are
trained as one process would train the global batch (the gradient data parallelism averages
to); where their widths differ, each rank's micro-batches are planned and scaled as that rank
would and the summed gradient is divided by the rank count, as FSDP's reduce-scatter
averages.  Used where FSDP would otherwise run on CPU ranks of one host:
``cpu_data_parallel: pool``, or ``auto`` (the default) for models of
:data:`~hf_fsdp.cpu_host.POOL_MIN_PARAMS` parameters and more; no mixed precision, and every
rank able to map the file; GPUs always shard with FSDP.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from hf_core.batch import Batch, BatchError
from hf_fsdp.config import FSDPEngineConfig
from hf_fsdp.cpu_host import HostPool, data_parallel_choice
from hf_fsdp.cpu_shared_memory import map_shared_file
from hf_fsdp.loading import mixed_precision

log = logging.getLogger(__name__)

_ALIGN = 64
"""Each tensor's offset in the shared file (bytes): whole cache lines, any dtype's alignment."""


def pooling_wanted(cfg: FSDPEngineConfig, device: torch.device, num_params: int) -> bool:
    """Whether the config asks for pooled training of a model of ``num_params`` where the
    ranks allow it (``auto``: from :data:`~hf_fsdp.cpu_host.POOL_MIN_PARAMS`)."""
    if device.type != "cpu" or data_parallel_choice(cfg.cpu_data_parallel, num_params) != "pool":
        return False
    return mixed_precision(cfg, device) is None and cfg.cpu_collectives == "shared_memory"


def _nbytes(param: nn.Parameter) -> int:
    return param.numel() * param.element_size()


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def owners(sizes: list[int], world: int) -> list[int]:
    """The rank that steps each parameter: contiguous runs of about ``1 / world`` of the
    bytes each (a parameter goes to the rank whose share holds its middle byte)."""
    total = sum(sizes) or 1
    out, before = [], 0
    for size in sizes:
        out.append(min(world - 1, int(world * (before + size / 2) / total)))
        before += size
    return out


def joined(parts: list[Batch]) -> Batch | None:
    """The ranks' batches as one, rows in rank order, or None where their keys or widths
    differ (a trainer's batch split over the ranks has one width)."""
    try:
        return Batch.concat(parts)
    except (BatchError, RuntimeError):
        return None


def _trainable(model: nn.Module, trains: bool) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad] if trains else []


def _layout_bytes(model: nn.Module, trains: bool) -> int:
    """The shared file's size: every weight, then every trainable weight's gradient."""
    weights = sum(_aligned(_nbytes(p)) for p in model.parameters())
    return weights + sum(_aligned(_nbytes(p)) for p in _trainable(model, trains))


class HostTraining:
    """One model's shared weights and gradients, and this rank's share of the optimizer."""

    def __init__(self, pool: HostPool, buffer: torch.Tensor, trains: bool) -> None:
        self.pool = pool
        self.buffer = buffer
        self.trains = trains
        self.owned: list[nn.Parameter] = []
        """The parameters this rank's optimizer steps (set by :meth:`bind`)."""

    @classmethod
    def plan(
        cls,
        model: nn.Module,
        cfg: FSDPEngineConfig,
        device: torch.device,
        group: dist.ProcessGroup,
    ) -> HostTraining | None:
        """Pooled training for ``model`` (its parameters may still be on the meta device),
        or None where the config, the device, the hosts or ``/dev/shm`` rule it out.
        Collective: every rank of the default group gets the same answer."""
        if not pooling_wanted(cfg, device, sum(p.numel() for p in model.parameters())):
            return None
        pool = HostPool.for_this_process(device)
        if pool is None:
            return None
        trainable = _trainable(model, cfg.trainable)
        if trainable and len(set(owners([_nbytes(p) for p in trainable], pool.world))) < pool.world:
            return None  # a rank would step nothing: an optimizer wants parameters
        size = _layout_bytes(model, cfg.trainable)
        buffer = map_shared_file(group, size)
        if buffer is None:
            log.info(
                "pooled training needs a %d MiB /dev/shm file every rank maps (twice that "
                "free): FSDP shards instead",
                size >> 20,
            )
            return None
        log.info(
            "%d ranks train one model (%d MiB of weights and gradients in /dev/shm), computed "
            "on rank 0 with %d threads",
            pool.world,
            size >> 20,
            pool.threads,
        )
        return cls(pool, buffer, cfg.trainable)

    @torch.no_grad()
    def bind(self, model: nn.Module) -> None:
        """Move the loaded weights into the shared file (rank 0's copy; every rank loaded
        the same) and point every rank's parameters and gradients at it.  Collective."""
        params = list(model.parameters())
        trainable = _trainable(model, self.trains)
        if _layout_bytes(model, self.trains) > self.buffer.numel():
            raise RuntimeError("the loaded model outgrew the shared file planned for it")
        offset = 0
        views: list[torch.Tensor] = []
        for param in params:
            views.append(self._view(offset, param))
            offset += _aligned(_nbytes(param))
        if self.pool.leader:
            for param, view in zip(params, views, strict=True):
                view.copy_(param.data)
        self.pool.broadcast(None)  # the weights are in place before anyone reads them
        for param, view in zip(params, views, strict=True):
            param.data = view
        for param in trainable:
            param.grad = self._view(offset, param)  # zeros: the file starts zeroed
            offset += _aligned(_nbytes(param))
        ranks = owners([_nbytes(p) for p in trainable], self.pool.world)
        self.owned = [p for p, r in zip(trainable, ranks, strict=True) if r == self.pool.rank]

    def _view(self, offset: int, param: nn.Parameter) -> torch.Tensor:
        nbytes = _nbytes(param)
        return self.buffer[offset : offset + nbytes].view(param.dtype).view(param.shape)

    def zero_owned_grads(self) -> None:
        """Each rank clears its share's gradients for the next update (in parallel)."""
        for param in self.owned:
            assert param.grad is not None
            param.grad.zero_()

    @contextmanager
    def gradients_detached(self) -> Iterator[None]:
        """The owned parameters without gradients for the block, then the shared ones back:
        DCP builds an optimizer's state before its first step only for parameters without
        gradients (and then clears them), as it does for an FSDP engine."""
        saved = [p.grad for p in self.owned]
        for param in self.owned:
            param.grad = None
        try:
            yield
        finally:
            for param, grad in zip(self.owned, saved, strict=True):
                param.grad = grad
