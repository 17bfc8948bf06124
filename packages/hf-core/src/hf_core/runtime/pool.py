"""ResourcePool: devices reserved on Ray placement groups, one bundle per worker rank."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


@dataclass(frozen=True)
class Slot:
    """Where one rank's worker process goes: a bundle of a placement group."""

    placement_group: PlacementGroup
    bundle_index: int
    node_index: int
    local_rank: int


class ResourcePool:
    """A set of bundles (CPU, or CPU+GPU) grouped per node.

    ``processes_per_node=[4, 4]`` reserves 4 ranks on each of two nodes (one placement group
    per node, ``STRICT_PACK`` so a node's ranks stay together).  Ranks are numbered node by node.
    ``max_colocate`` lets that many separate worker groups share each bundle (the "colocated,
    other process" placement); roles that share one process need no such room.
    """

    def __init__(
        self,
        processes_per_node: list[int],
        *,
        use_gpu: bool = False,
        cpus_per_process: float = 1.0,
        max_colocate: int = 1,
        name: str = "pool",
        ready_timeout_s: float = 60.0,
    ) -> None:
        if not processes_per_node or any(n < 1 for n in processes_per_node):
            raise ValueError(
                f"processes_per_node must be positive counts, got {processes_per_node}"
            )
        if max_colocate < 1:
            raise ValueError(f"max_colocate must be >= 1, got {max_colocate}")
        self.processes_per_node = list(processes_per_node)
        self.use_gpu = use_gpu
        self.cpus_per_process = cpus_per_process
        self.max_colocate = max_colocate
        self.name = name
        self.ready_timeout_s = ready_timeout_s
        self._groups: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.processes_per_node)

    def bundle_resources(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_process}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        return bundle

    def actor_resources(self) -> dict[str, float]:
        """What one worker process asks for: its share of a bundle."""
        share = 1.0 / self.max_colocate
        resources = {"num_cpus": self.cpus_per_process * share}
        if self.use_gpu:
            resources["num_gpus"] = share
        return resources

    def placement_groups(self) -> list[PlacementGroup]:
        """Create (once) and wait for the placement groups; a pool too big is a clear error."""
        if self._groups is None:
            strategy = "STRICT_PACK" if len(self.processes_per_node) > 1 else "PACK"
            groups = [
                placement_group(
                    [self.bundle_resources() for _ in range(count)],
                    strategy=strategy,
                    name=f"{self.name}_node{i}",
                )
                for i, count in enumerate(self.processes_per_node)
            ]
            ready, _ = ray.wait(
                [g.ready() for g in groups], num_returns=len(groups), timeout=self.ready_timeout_s
            )
            if len(ready) != len(groups):
                for group in groups:
                    remove_placement_group(group)
                raise RuntimeError(
                    f"resource pool {self.name!r} could not reserve {self.processes_per_node} "
                    f"bundles of {self.bundle_resources()} within {self.ready_timeout_s:.0f} s; "
                    f"cluster has {ray.cluster_resources()}"
                )
            self._groups = groups
        return self._groups

    def slots(self) -> list[Slot]:
        slots: list[Slot] = []
        for node, (group, count) in enumerate(
            zip(self.placement_groups(), self.processes_per_node, strict=True)
        ):
            slots.extend(Slot(group, i, node, i) for i in range(count))
        return slots

    def release(self) -> None:
        """Give the bundles back to Ray."""
        for group in self._groups or []:
            remove_placement_group(group)
        self._groups = None
