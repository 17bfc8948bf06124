"""ProcessSet: the Ray actors of one spawn, one process per rank, shared by colocated roles.

Starts one :class:`~hf_core.runtime.worker_process.WorkerProcess` per bundle of a resource pool
(each with its stack watchdog and the workers' process environment), waits for them to come up
and sets up torch.distributed across them (gloo on CPU, nccl on GPU).  Waiting on their results
goes through :class:`~hf_core.runtime.liveness.Liveness`, so a start-up that hangs or dies is
reported like any other call; a half-started set is shut down, leaving no bundles held.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Mapping

import ray

from hf_core.runtime.liveness import Liveness
from hf_core.runtime.pool import ResourcePool
from hf_core.runtime.process_env import worker_process_env
from hf_core.runtime.worker_process import CONTROL_GROUP, RoleSpec, WorkerProcess

_WATCHDOG_SHARE = 0.8
"""A rank's own stack watchdog fires after this share of ``failure_timeout_s`` without a
heartbeat, so its dump is written before the controller (bound: the whole timeout) reports it."""


class ProcessSet:
    """The worker processes of one spawn: shared by the role groups colocated on them."""

    def __init__(
        self,
        pool: ResourcePool,
        roles: dict[str, RoleSpec],
        *,
        name: str,
        dist_backend: str | None,
        env: Mapping[str, str] | None,
        failure_timeout_s: float,
        startup_timeout_s: float,
        stacks_dir: str | None = None,
    ) -> None:
        self.pool, self.name = pool, name
        stacks_dir = stacks_dir or os.path.join(tempfile.gettempdir(), "hybridflow-stacks")
        # No task events: Ray's GCS would keep one per method call (the trainer's metrics
        # time every stage), growing for the whole run until its cap (the soak showed it).
        remote_process = ray.remote(
            concurrency_groups={CONTROL_GROUP: 1}, enable_task_events=False
        )(WorkerProcess)
        slots = pool.slots()
        uid = uuid.uuid4().hex[:6]
        stack_files = [
            os.path.join(stacks_dir, f"{name}_{uid}_rank{rank}.txt") for rank in range(len(slots))
        ]
        env_vars = worker_process_env()
        process_env = {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
        self.actors = [
            remote_process.options(
                **pool.actor_resources(),
                scheduling_strategy=ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                    placement_group=slot.placement_group,
                    placement_group_bundle_index=slot.bundle_index,
                ),
                name=f"{name}_{uid}_rank{rank}",
                **process_env,
            ).remote(
                roles,
                rank,
                len(slots),
                slot.local_rank,
                {"LOCAL_WORLD_SIZE": str(pool.processes_per_node[slot.node_index]), **(env or {})},
                stacks_file=stack_files[rank],
                watchdog_s=failure_timeout_s * _WATCHDOG_SHARE,
            )
            for rank, slot in enumerate(slots)
        ]
        self.world_size = len(self.actors)
        self.liveness = Liveness(self.actors, name, failure_timeout_s, stacks_dir, stack_files)
        self.wait = self.liveness.wait
        """Results of one call's refs, or the first failure (:meth:`Liveness.wait`)."""
        backend = dist_backend
        if backend == "auto":
            backend = "nccl" if pool.use_gpu else "gloo"
        try:
            # Starting a process and importing torch can take long on a loaded machine:
            # heartbeats only count once every rank is up.
            master_addr, master_port = self.wait(
                [self.actors[0].address.remote()],
                [0],
                ",".join(roles),
                "address",
                silence_s=startup_timeout_s,
            )[0]
            setups = [
                a.setup.remote(master_addr, master_port, backend, failure_timeout_s * 10)
                for a in self.actors
            ]
            self.pids: list[int] = self.wait(
                setups,
                list(range(self.world_size)),
                ",".join(roles),
                "setup",
                silence_s=startup_timeout_s,
            )
        except BaseException:
            self.shutdown()  # no half-started group left holding bundles
            raise

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors.clear()
        self.liveness.broken = "shut down"
        self.liveness.remove_empty_stack_files()
