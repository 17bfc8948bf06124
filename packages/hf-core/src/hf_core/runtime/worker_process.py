"""WorkerProcess: the Ray actor (one process per rank) that runs one or more role workers.

Running several roles in one worker process is how colocation works: the roles share the process,
its memory and its torch.distributed group, and the controller still addresses each role as its own
:class:`~hf_core.runtime.group.WorkerGroup`.

Hang diagnosis: each worker process appends its Python stacks to one file (``stacks_file``) when the
controller asks (:meth:`WorkerProcess.dump_stacks`, on the control thread), and by itself when a
running call goes ``watchdog_s`` without a heartbeat (:class:`StackWatchdog`), which covers a rank
frozen while holding the GIL, whose control thread can answer nothing.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from hf_core.errors import EngineDiedError
from hf_core.protocols.mesh import WorkerMesh
from hf_core.runtime.errors import WorkerError, WorkerLostError
from hf_core.worker import StaleMeshError, Worker, build_worker

log = logging.getLogger(__name__)

CONTROL_GROUP = "control"
"""Concurrency group for heartbeats, so a ping is answered while a long method runs."""


class StackWatchdog:
    """Dumps every thread's stack to a file when a running call misses its heartbeats.

    Armed while a method executes and re-armed by each heartbeat; if none comes for
    ``bound_s`` it fires.  ``faulthandler``'s timer is a C thread that needs no GIL, so it
    fires even when the method holds the GIL forever (a deadlock in C code), which is exactly
    when the control thread cannot answer pings or dump requests.  The file is opened on first
    use, in append mode, so dumps of successive failures accumulate.

    Heartbeats come only while the controller waits on the call: a driver that starts a call
    (``.remote``) and then computes for longer than ``bound_s`` before waiting gets a dump of
    a healthy rank (the header says "Timeout"); harmless, and the run goes on.
    """

    def __init__(self, path: str | None, bound_s: float | None) -> None:
        self.path, self.bound_s = path, bound_s
        self._lock = threading.Lock()  # the control thread beats while the main thread runs
        self._running = False
        self._file: Any = None

    def start(self) -> None:
        with self._lock:
            self._running = True
            self._arm()

    def beat(self) -> None:
        with self._lock:
            if self._running:
                self._arm()

    def stop(self) -> None:
        with self._lock:
            self._running = False
            if self._file is not None:
                faulthandler.cancel_dump_traceback_later()

    def _arm(self) -> None:
        if self.path is None or self.bound_s is None:
            return
        if self._file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = open(self.path, "a")  # kept open: the C thread writes to it
        faulthandler.dump_traceback_later(self.bound_s, repeat=False, file=self._file)


@dataclass(frozen=True)
class RoleSpec:
    """A role's worker class and its constructor arguments."""

    cls: type[Worker]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class WorkerProcess:
    """Runs in its own process; constructs role workers and executes their methods."""

    def __init__(
        self,
        roles: dict[str, RoleSpec],
        rank: int,
        world_size: int,
        local_rank: int,
        env: dict[str, str],
        stacks_file: str | None = None,
        watchdog_s: float | None = None,
    ) -> None:
        os.environ.update(env)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
        self.rank, self.world_size = rank, world_size
        self.role_specs = roles
        self.workers: dict[str, Worker] = {}
        self.stacks_file = stacks_file
        self.watchdog = StackWatchdog(stacks_file, watchdog_s)

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
        self.watchdog.start()
        try:
            return getattr(worker, method)(*args, **kwargs)
        except EngineDiedError as exc:  # the process lives on, but its engine cannot serve
            log.error("role %r rank %d: %s", role, self.rank, exc, exc_info=exc)
            raise WorkerLostError(role, self.rank, method, f"engine died: {exc}") from None
        except Exception as exc:
            raise _wrap(exc, role, self.rank, method) from None
        finally:
            self.watchdog.stop()

    def mesh(self, role: str) -> tuple[int, WorkerMesh]:
        worker = self.workers[role]
        return worker.mesh_version, worker.mesh

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> int:
        self.watchdog.beat()
        return os.getpid()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def dump_stacks(self, reason: str) -> str | None:
        """Append every thread's Python stack to this rank's stacks file (the controller asks
        when a peer died or hung: the survivors' stacks show where they wait)."""
        if self.stacks_file is None:
            return None
        os.makedirs(os.path.dirname(self.stacks_file) or ".", exist_ok=True)
        with open(self.stacks_file, "a") as out:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"=== {stamp} rank {self.rank} pid {os.getpid()}: {reason}\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        return self.stacks_file

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
