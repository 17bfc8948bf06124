"""The FSDP mesh and the small collectives the engines use.

Role workers normally start with torch.distributed already set up by hf-core's runtime.  A
script or a unit test that builds an engine on its own gets a one-rank group from
:func:`hf_core.device.ensure_process_group`, so the same FSDP code path runs everywhere (a
one-rank FSDP2 model behaves exactly like a plain one).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hf_core.device import collective_device


def data_parallel_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over every rank of the default group: FSDP shards over all of them."""
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def all_reduce_int(value: int, op: dist.ReduceOp = dist.ReduceOp.SUM) -> int:
    """Sum (or max, ...) of an integer over all ranks; the backend decides the device."""
    tensor = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (small picklable objects only: metrics, names)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank."""
    box = [value if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
