"""FSDP2 shards: each rank holds a dim-0 shard of every parameter, gathers a unit's weights
before using them and reduce-scatters its gradients after.

The strategy a GPU run takes, and by default CPU ranks too (:mod:`hf_fsdp.data_parallel.choice`),
so every multi-rank feature is tested on it.  CPU ranks on one host copy FSDP's collectives
through a shared-memory file instead of gloo's loopback TCP (``cpu_collectives``,
:mod:`hf_fsdp.cpu_shared_memory`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from hf_fsdp import cpu_shared_memory
from hf_fsdp.config import FSDPEngineConfig
from hf_fsdp.data_parallel.base import DataParallel
from hf_fsdp.data_parallel.choice import FSDP2
from hf_fsdp.loading import shard_model


class FSDP2Shards(DataParallel):
    """``fully_shard`` per decoder layer and at the root (:func:`hf_fsdp.loading.shard_model`)."""

    name = FSDP2

    def __init__(
        self, mesh: DeviceMesh, cfg: FSDPEngineConfig, device: torch.device, rank: int, world: int
    ) -> None:
        super().__init__(rank, world, cfg.sequence_parallel_size)
        self.mesh, self.cfg, self.device = mesh, cfg, device
        self.state_ranks = world

    def prepare(self, model: nn.Module) -> None:
        shard_model(model, self.mesh, self.cfg, self.device)
        shared = self.device.type == "cpu" and self.cfg.cpu_collectives == "shared_memory"
        if shared and cpu_shared_memory.attach(model, self.mesh.get_group()):
            self.collectives = "shared_memory"

    def release(self, model: nn.Module) -> None:
        """Put the sharded parameters back: the root keeps its gathered parameters after a
        forward, waiting for a backward that does not come after a forward-only pass."""
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
