"""Cluster: start a local Ray instance, or join an existing (multi-node) one."""

from __future__ import annotations

import os
from typing import Any

import ray


class Cluster:
    """Context manager around ``ray.init``.

    * ``address=None`` and no ``RAY_ADDRESS`` in the environment: start a local Ray instance
      (``num_cpus`` / ``num_gpus`` default to what Ray detects);
    * ``address="auto"`` or ``RAY_ADDRESS`` set: join the running cluster started with
      ``ray start --head`` (and ``ray start --address=HEAD:6379`` on the other nodes).

    If Ray is already initialised in this process the cluster is reused and left running.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        temp_dir: str | None = None,
        runtime_env: dict[str, Any] | None = None,
    ) -> None:
        self.address = address or os.environ.get("RAY_ADDRESS")
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.temp_dir = temp_dir
        self.runtime_env = runtime_env
        self._started = False

    def __enter__(self) -> Cluster:
        if ray.is_initialized():
            return self
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if self.runtime_env:
            kwargs["runtime_env"] = self.runtime_env
        if self.address:
            ray.init(address=self.address, **kwargs)
        else:
            if self.temp_dir:
                kwargs["_temp_dir"] = self.temp_dir
            ray.init(num_cpus=self.num_cpus, num_gpus=self.num_gpus, **kwargs)
        self._started = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._started:
            ray.shutdown()
            self._started = False

    @staticmethod
    def resources() -> dict[str, float]:
        return dict(ray.cluster_resources())


def resolve_use_gpu(choice: bool | str) -> bool:
    """``cluster.use_gpu``: ``auto`` is True when the connected Ray cluster has GPUs."""
    if choice == "auto":
        return float(ray.cluster_resources().get("GPU", 0.0)) > 0
    return bool(choice)
