"""The planner's answer: pools of colocated models, their layouts and the estimated times.

``plan_to_placement`` flattens a plan into plain data a runner turns into resource pools
(``processes_per_node`` per pool) and worker layouts, without importing the runtime here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_core.planner.devices import GIB, DeviceCluster
from hf_core.planner.workload import Workload
from hf_core.resharding import GenerationLayout, ParallelLayout

if TYPE_CHECKING:
    from rich.table import Table


@dataclass(frozen=True)
class ModelPlan:
    """One role's share of a plan: its layout, memory and per-stage seconds.

    ``layout`` is the training layout of trained roles and the forward layout of
    inference-only ones; ``generation`` is set for the generating role only.
    """

    role: str
    model: str
    params: int
    trained: bool
    devices: int
    layout: ParallelLayout
    generation: GenerationLayout | None
    persistent_bytes: float
    transient_bytes: float
    stage_seconds: Mapping[str, float]
    transition_seconds: float = 0.0
    generation_waves: int | None = None
    generation_bytes: float = 0.0
    """Transient bytes while generating: the gathered generation shard plus KV cache in use."""

    @property
    def seconds(self) -> float:
        """All of this model's work in an iteration (its contribution inside its pool)."""
        return sum(self.stage_seconds.values())


@dataclass(frozen=True)
class PoolPlan:
    """A colocated set: its roles share ``devices`` and run one after another."""

    roles: tuple[str, ...]
    devices: int
    node_slots: tuple[tuple[int, int], ...]
    """``(node index, devices on it)`` for each node the pool uses."""
    models: tuple[ModelPlan, ...]
    stage_seconds: Mapping[str, float]
    peak_bytes: float
    """Per-device peak: everyone's resident state plus the largest transient of the pool."""
    usable_bytes: float

    @property
    def name(self) -> str:
        """A readable pool name, e.g. ``actor+reference``."""
        return "+".join(self.roles)


@dataclass(frozen=True)
class Plan:
    """A device mapping with its estimated cost (Algorithm 1's output for one placement)."""

    algorithm: str
    cluster: DeviceCluster
    workload: Workload
    pools: tuple[PoolPlan, ...]
    stage_seconds: Mapping[str, float]
    """Per stage: max over pools of the sum inside each pool (generation includes reshard)."""
    iteration_seconds: float

    @property
    def placement(self) -> tuple[tuple[str, ...], ...]:
        """The colocated sets."""
        return tuple(p.roles for p in self.pools)

    @property
    def allocation(self) -> tuple[int, ...]:
        """Devices per colocated set, in placement order."""
        return tuple(p.devices for p in self.pools)

    @property
    def models(self) -> dict[str, ModelPlan]:
        """Per-role choices, in dataflow order within pools."""
        return {m.role: m for pool in self.pools for m in pool.models}

    @property
    def transition_seconds(self) -> float:
        """The actor's training -> generation reshard (already inside ``generation``)."""
        return sum(m.transition_seconds for m in self.models.values())

    @property
    def tokens_per_second(self) -> float:
        """Throughput as the paper counts it: prompt + response tokens per iteration second."""
        return self.workload.tokens / self.iteration_seconds

    @property
    def kind(self) -> str:
        """``colocate`` (one pool), ``standalone`` (one model per pool) or ``split``."""
        if len(self.pools) == 1:
            return "colocate"
        if all(len(p.roles) == 1 for p in self.pools):
            return "standalone"
        return "split"

    def describe(self) -> str:
        """One line: kind, then each pool with its device count."""
        pools = " / ".join(f"{p.name}:{p.devices}" for p in self.pools)
        return f"{self.kind} [{pools}]"

    def render(self) -> Table:
        """A rich table of pools, layouts, memory and per-stage seconds."""
        from hf_core.planner.render import plan_table

        return plan_table(self)


def _layout_dict(layout: ParallelLayout) -> dict[str, Any]:
    """Plain-data form of a training layout."""
    return {"pp": layout.pp, "tp": layout.tp, "dp": layout.dp, "order": layout.order}


def _micro_dp(train: ParallelLayout, gen: GenerationLayout) -> int | None:
    """``d_g`` of the 3D-HybridEngine; ``None`` when a data-parallel layout hands whole tensors
    to a TP rollout (``t_g`` need not divide ``t`` then, and there is no reshard)."""
    if train.tp % gen.tp or train.pp % gen.pp:
        return None
    return gen.micro_dp_size(train)


def plan_to_placement(plan: Plan) -> dict[str, Any]:
    """Plain data for a runner: one entry per pool (roles, device count, per-node process
    counts for a ``ResourcePool``, node slots) with each role's layouts, plus the estimates."""
    pools = []
    for pool in plan.pools:
        layouts: dict[str, Any] = {}
        for m in pool.models:
            entry: dict[str, Any] = {"model": m.model, "trained": m.trained}
            if m.trained:
                entry["train"] = _layout_dict(m.layout)
            entry["infer"] = _layout_dict(m.layout)  # forward passes reuse the training layout
            if m.generation is not None:
                entry["generation"] = {
                    "pp": m.generation.pp,
                    "tp": m.generation.tp,
                    "micro_dp": _micro_dp(m.layout, m.generation),
                    "replicas": m.devices // (m.generation.tp * m.generation.pp),
                }
            layouts[m.role] = entry
        pools.append(
            {
                "name": pool.name,
                "roles": list(pool.roles),
                "devices": pool.devices,
                "processes_per_node": [count for _, count in pool.node_slots],
                "nodes": [node for node, _ in pool.node_slots],
                "peak_memory_gib": round(pool.peak_bytes / GIB, 2),
                "layouts": layouts,
            }
        )
    return {
        "algorithm": plan.algorithm,
        "kind": plan.kind,
        "cluster": {
            "nodes": plan.cluster.nodes,
            "devices_per_node": plan.cluster.devices_per_node,
            "device": plan.cluster.device.name,
        },
        "pools": pools,
        "estimated_seconds": {
            **{k: round(v, 3) for k, v in plan.stage_seconds.items()},
            "transition": round(plan.transition_seconds, 3),
            "iteration": round(plan.iteration_seconds, 3),
        },
    }
