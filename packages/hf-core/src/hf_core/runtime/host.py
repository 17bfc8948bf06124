"""WorkerHost: the Ray actor (one process per rank) that hosts one or more role workers.

Hosting several roles in one host is how colocation works: the roles share the process, its
memory and its torch.distributed group, and the controller still addresses each role as its
own :class:`~hf_core.runtime.group.WorkerGroup`.
"""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from hf_core.protocols.mesh import WorkerMesh
from hf_core.runtime.errors import WorkerError
from hf_core.worker import StaleMeshError, Worker, build_worker

CONTROL_GROUP = "control"
"""Concurrency group for heartbeats, so a ping is answered while a long method runs."""


@dataclass(frozen=True)
class RoleSpec:
    """A role's worker class and its constructor arguments."""

    cls: type[Worker]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class WorkerHost:
    """Runs in its own process; constructs role workers and executes their methods."""

    def __init__(
        self,
        roles: dict[str, RoleSpec],
        rank: int,
        world_size: int,
        local_rank: int,
        env: dict[str, str],
    ) -> None:
        os.environ.update(env)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
        self.rank, self.world_size = rank, world_size
        self.role_specs = roles
        self.workers: dict[str, Worker] = {}

    # ------------------------------------------------------------- bootstrap
    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port (rank 0's become the rendezvous point)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(
        self, master_addr: str, master_port: int, backend: str | None, timeout_s: float
    ) -> int:
        """Join the group's torch.distributed group, then build the role workers."""
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if backend is not None and not dist.is_initialized():
            if backend == "nccl":
                torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU(s)
            dist.init_process_group(
                backend=backend,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        for role, spec in self.role_specs.items():
            try:
                self.workers[role] = build_worker(role, spec.cls, *spec.args, **spec.kwargs)
            except Exception as exc:
                raise _wrap(exc, role, self.rank, "__init__") from None
        return os.getpid()

    # -------------------------------------------------------------- execution
    def execute(
        self, role: str, method: str, mesh_version: int | None, *args: Any, **kwargs: Any
    ) -> Any:
        worker = self.workers[role]
        if mesh_version is not None and mesh_version != worker.mesh_version:
            raise StaleMeshError(f"mesh version {worker.mesh_version} != expected {mesh_version}")
        try:
            return getattr(worker, method)(*args, **kwargs)
        except Exception as exc:
            raise _wrap(exc, role, self.rank, method) from None

    def mesh(self, role: str) -> tuple[int, WorkerMesh]:
        worker = self.workers[role]
        return worker.mesh_version, worker.mesh

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wrap(exc: BaseException, role: str, rank: int, method: str) -> WorkerError:
    return WorkerError(
        role=role,
        rank=rank,
        method=method,
        exc_type=type(exc).__name__,
        message=str(exc),
        remote_tb="".join(traceback.format_exception(exc)),
    )
