"""The base class of every role worker: one instance per rank, run SPMD.

A worker knows its rank, the group's world size and its mesh coordinates (which the 3D transfer
protocols read).  Several roles may live in one process (colocation); each is still its own
worker object and reaches the others through :meth:`Worker.colocated`.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from hf_core.device import default_device
from hf_core.protocols.mesh import WorkerMesh

_LOCAL_WORKERS: dict[str, Worker] = {}
"""Role name -> worker object for the roles running in this process."""

_ROLE_BEING_BUILT: list[str] = []


class StaleMeshError(RuntimeError):
    """The controller dispatched with an outdated view of this worker's mesh."""


class Worker:
    """Subclass this and decorate methods with :func:`hf_core.protocols.register`."""

    role: str
    rank: int
    world_size: int
    local_rank: int
    _known_roles: ClassVar[dict[str, Worker]] = _LOCAL_WORKERS

    def __init__(self) -> None:
        self.role = _ROLE_BEING_BUILT[-1] if _ROLE_BEING_BUILT else type(self).__name__
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._mesh = WorkerMesh(dp_rank=self.rank, dp_size=self.world_size)
        self._mesh_version = 0

    # ------------------------------------------------------------------ mesh
    @property
    def mesh(self) -> WorkerMesh:
        return self._mesh

    @property
    def mesh_version(self) -> int:
        return self._mesh_version

    def set_mesh(self, mesh: WorkerMesh) -> None:
        """Report new parallel coordinates (e.g. after an engine built its TP/PP/SP groups)."""
        world = mesh.dp_size * mesh.tp_size * mesh.pp_size * mesh.sp_size
        if world != self.world_size:
            raise ValueError(
                f"mesh dp*tp*pp*sp = {mesh.dp_size}*{mesh.tp_size}*{mesh.pp_size}*"
                f"{mesh.sp_size} = {world} does not match world size {self.world_size}"
            )
        self._mesh = mesh
        self._mesh_version += 1

    # ---------------------------------------------------------------- device
    @property
    def device(self) -> torch.device:
        """The accelerator this rank drives (Ray sets CUDA_VISIBLE_DEVICES per actor)."""
        return default_device()

    # ------------------------------------------------------------ colocation
    def colocated(self, role: str) -> Worker:
        """The worker of another role running in this same process (shares its memory)."""
        if role not in self._known_roles:
            raise KeyError(
                f"role {role!r} is not colocated with {self.role!r} in this process "
                f"(here: {sorted(self._known_roles)})"
            )
        return self._known_roles[role]


def build_worker(role: str, cls: type[Worker], *args: object, **kwargs: object) -> Worker:
    """Instantiate a role's worker so that it knows its role name and its colocated peers."""
    _ROLE_BEING_BUILT.append(role)
    try:
        worker = cls(*args, **kwargs)
    finally:
        _ROLE_BEING_BUILT.pop()
    if not isinstance(worker, Worker):
        raise TypeError(f"role {role!r}: {cls.__name__} is not a hf_core.worker.Worker subclass")
    _LOCAL_WORKERS[role] = worker
    return worker
