"""The single-controller runtime on Ray: pools, worker processes, worker groups, futures."""

from hf_core.runtime.cluster import Cluster
from hf_core.runtime.errors import GroupBrokenError, WorkerError, WorkerLostError
from hf_core.runtime.group import GroupFuture, WorkerGroup, spawn
from hf_core.runtime.pool import ResourcePool
from hf_core.runtime.worker_process import RoleSpec

__all__ = [
    "Cluster",
    "GroupBrokenError",
    "GroupFuture",
    "ResourcePool",
    "RoleSpec",
    "WorkerError",
    "WorkerGroup",
    "WorkerLostError",
    "spawn",
]
