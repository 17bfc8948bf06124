"""The FSDP engine's data-parallel strategy, chosen once, when the engine is built."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hf_fsdp.config import FSDPEngineConfig
from hf_fsdp.data_parallel.base import DataParallel
from hf_fsdp.data_parallel.choice import (
    CPU_LEADER,
    CPU_REPLICAS,
    STRATEGIES,
    strategy_for,
)
from hf_fsdp.data_parallel.cpu_leader import CPULeader
from hf_fsdp.data_parallel.cpu_replicas import CPUReplicas
from hf_fsdp.data_parallel.fsdp2 import FSDP2Shards
from hf_fsdp.distributed import all_reduce_int

log = logging.getLogger(__name__)


def build(
    cfg: FSDPEngineConfig, device: torch.device, model: nn.Module, mesh: DeviceMesh
) -> DataParallel:
    """The strategy :mod:`hf_fsdp.data_parallel.choice` gives for ``model`` (its parameters
    may be on the meta device), FSDP2 where a CPU strategy cannot run here.  Collective:
    every rank of the group gets the same strategy (hosts may differ in memory)."""
    group = mesh.get_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    wanted = strategy_for(cfg, device, sum(p.numel() for p in model.parameters()), world)
    if world > 1:
        wanted = STRATEGIES[all_reduce_int(STRATEGIES.index(wanted), dist.ReduceOp.MIN)]
    strategy: DataParallel | None = None
    if wanted == CPU_LEADER:
        strategy = CPULeader.build(model, device, group)
    elif wanted == CPU_REPLICAS:
        strategy = CPUReplicas.build(group)
    if strategy is None:
        strategy = FSDP2Shards(mesh, cfg, device, rank, world)
    if strategy.name != wanted:
        log.info("%s cannot run on these ranks: FSDP2 shards instead", wanted)
    return strategy
