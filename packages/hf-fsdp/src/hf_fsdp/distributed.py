"""Process-group and device helpers shared by the engines.

Role workers normally start with torch.distributed already set up by hf-core's runtime.  A
script or a unit test that builds an engine on its own gets a one-rank group here, so the same
FSDP code path runs everywhere (a one-rank FSDP2 model behaves exactly like a plain one).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

log = logging.getLogger(__name__)


def resolve_device(choice: str) -> torch.device:
    """``auto`` picks this rank's GPU if there is one, else the CPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was asked for but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ensure_process_group(device: torch.device) -> None:
    """Initialise a one-rank group when nobody did (nccl for GPU, gloo for CPU)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    log.info("torch.distributed not initialised: starting a one-rank %s group", backend)
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def data_parallel_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over every rank of the default group: FSDP shards over all of them."""
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def all_reduce_int(value: int, op: dist.ReduceOp = dist.ReduceOp.SUM) -> int:
    """Sum (or max, ...) of an integer over all ranks; the backend decides the device."""
    tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device())
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


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
