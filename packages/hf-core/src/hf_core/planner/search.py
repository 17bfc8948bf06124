"""Algorithm 1: search placements x allocations x per-model strategies for the fastest plan.

For each placement (set partition of the models) and each allocation of all devices to its
sets, each set is costed on its own -- its models' strategies chosen together, because they
share the devices' memory -- and the plan's score is ``d_cost``: per stage the max over sets
of the sum inside a set, summed over stages.  Two caches make this cheap: strategies per
``(model, devices)`` (Algorithm 2's result is the same whatever the placement) and costed sets
per ``(set, devices)`` (the same set recurs in many placements and allocations).

Per-role :class:`~hf_core.planner.autoparallel.RoleParallelism` limits (the axes the installed
engines support, sizes a user fixed) narrow Algorithm 2; roles that must share one layout when
colocated are costed once per common ``(t, p)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_core.planner.autoparallel import (
    FREE,
    Candidate,
    RoleModel,
    RoleParallelism,
    auto_parallel,
    pareto,
)
from hf_core.planner.colocation import PoolResult, cost_pool
from hf_core.planner.dataflow import VALUE_HEAD_ROLES, Dataflow, get_dataflow
from hf_core.planner.devices import DeviceCluster
from hf_core.planner.diagnostics import nothing_fits, too_big
from hf_core.planner.models import ModelSpec, load_model
from hf_core.planner.placement import allocations, allowed_sizes, assign_nodes, set_partitions
from hf_core.planner.plan import ModelPlan, Plan, PoolPlan
from hf_core.planner.score import combine
from hf_core.planner.workload import Workload
from hf_core.resharding import GenerationLayout

ModelSource = ModelSpec | str | Path | Mapping[str, Any]
SharedLayout = dict[str, tuple[int, int]]
"""``(t, p)`` imposed on roles that must share their layout inside one pool."""


@dataclass
class CacheStats:
    """Hits and misses of one cache, so tests and benchmarks can see reuse."""

    hits: int = 0
    misses: int = 0


class Planner:
    """Auto-mapping of one dataflow onto one cluster (HybridFlow §6).

    Construct once, call :meth:`plan`; the caches persist, so re-planning with another
    ``top_k`` or a restricted set of placements reuses every costed model and set.
    ``parallelism`` limits the layouts of some roles (the engines' axes, fixed sizes); roles
    left out are unconstrained.
    """

    def __init__(
        self,
        dataflow: Dataflow | str,
        models: Mapping[str, ModelSource],
        workload: Workload | Mapping[str, Any] | None,
        cluster: DeviceCluster,
        parallelism: Mapping[str, RoleParallelism] | None = None,
    ) -> None:
        self.dataflow = get_dataflow(dataflow)
        self.workload = (
            workload if isinstance(workload, Workload) else Workload.model_validate(workload or {})
        )
        self.cluster = cluster
        self.roles = self._bind(models, parallelism or {})
        self.stages = self.dataflow.stage_names()
        self.candidate_cache = CacheStats()
        self.pool_cache = CacheStats()
        self._candidates: dict[tuple[str, int], list[Candidate]] = {}
        self._pools: dict[tuple[tuple[str, ...], int], PoolResult | None] = {}
        self._sizes: dict[tuple[str, ...], list[int]] = {}
        self.allocations_scored = 0
        """(placement, allocation) pairs scored by ``d_cost`` so far."""

    def _bind(
        self, models: Mapping[str, ModelSource], parallelism: Mapping[str, RoleParallelism]
    ) -> dict[str, RoleModel]:
        """Pair each role of the dataflow with its model (critics and scorers get value heads)
        and its parallelism limits."""
        needed = self.dataflow.roles
        unknown = sorted(set(parallelism) - set(needed))
        if unknown:
            raise ValueError(
                f"parallelism given for {unknown}, but algorithm {self.dataflow.name!r} uses "
                f"roles {list(needed)}"
            )
        missing = [r for r in needed if r not in models]
        extra = sorted(set(models) - set(needed))
        if missing or extra:
            raise ValueError(
                f"algorithm {self.dataflow.name!r} uses roles {list(needed)}: "
                + (f"missing {missing}" if missing else "")
                + ("; " if missing and extra else "")
                + (f"unknown {extra}" if extra else "")
            )
        bound = {}
        for role in needed:
            spec = load_model(models[role])
            if role in VALUE_HEAD_ROLES:
                spec = spec.with_value_head()
            ops = tuple(self.dataflow.stage_ops(role))
            bound[role] = RoleModel(role, spec, ops, parallelism.get(role, FREE))
        return bound

    # ------------------------------------------------------------------ Algorithm 2, cached
    def candidates(self, role: str, devices: int) -> list[Candidate]:
        """``auto_parallel`` for one model on ``devices``, cached per (model, devices)."""
        key = (role, devices)
        if key in self._candidates:
            self.candidate_cache.hits += 1
        else:
            self.candidate_cache.misses += 1
            self._candidates[key] = auto_parallel(
                self.roles[role], devices, self.workload, self.cluster
            )
        return self._candidates[key]

    # ------------------------------------------------------------------ one colocated set
    def pool(self, roles: Sequence[str], devices: int) -> PoolResult | None:
        """The best joint strategy of a colocated set on ``devices`` (``None``: cannot fit),
        cached per (set, devices)."""
        key = (tuple(roles), devices)
        if key in self._pools:
            self.pool_cache.hits += 1
        else:
            self.pool_cache.misses += 1
            self._pools[key] = self._cost_pool(key[0], devices)
        return self._pools[key]

    def _cost_pool(self, roles: tuple[str, ...], devices: int) -> PoolResult | None:
        """Gather each model's strategies (Pareto fronts; all of the generator's) and let
        :func:`~hf_core.planner.colocation.cost_pool` choose them jointly -- once per common
        ``(t, p)`` of roles that must share a layout, keeping the fastest."""
        gen = self.dataflow.generator
        generator = self.roles[gen] if gen in roles else None
        strategies: dict[str, list[Candidate]] = {}
        for role in roles:
            strategies[role] = self.candidates(role, devices)
            if not strategies[role]:
                return None
        best: PoolResult | None = None
        for shared in self._shared_layouts(roles, strategies):
            fronts: dict[str, list[Candidate]] = {}
            for role in roles:
                cands = [
                    c
                    for c in strategies[role]
                    if role not in shared or (c.layout.tp, c.layout.pp) == shared[role]
                ]
                fronts[role] = cands if role == gen else pareto(cands)
            result = cost_pool(
                roles, devices, fronts, generator, self.workload, self.cluster, self.stages
            )
            if result is not None and (best is None or result.busy < best.busy):
                best = result
        return best

    def _shared_layouts(
        self, roles: Sequence[str], strategies: Mapping[str, list[Candidate]]
    ) -> list[SharedLayout]:
        """Every way to give each group of roles that must share a layout one common
        ``(t, p)`` all of them can use; ``[{}]`` when no two roles of the pool are tied."""
        groups: dict[str, list[str]] = {}
        for role in roles:
            key = self.roles[role].parallelism.shared_layout
            if key is not None:
                groups.setdefault(key, []).append(role)
        options: list[list[SharedLayout]] = []
        for members in groups.values():
            if len(members) < 2:
                continue
            usable = [{(c.layout.tp, c.layout.pp) for c in strategies[r]} for r in members]
            common = sorted(set.intersection(*usable))
            options.append([dict.fromkeys(members, tp_pp) for tp_pp in common])
        return [
            {role: tp_pp for choice in combo for role, tp_pp in choice.items()}
            for combo in itertools.product(*options)
        ]

    # ------------------------------------------------------------------ get_min_alloc
    def pool_sizes(self, roles: Sequence[str]) -> list[int]:
        """Allowed device counts on which the set fits, ascending; the first is ``A_min``.

        Sizes below the memory lower bound (all states / usable memory per device) are
        skipped without costing them.
        """
        key = tuple(roles)
        if key not in self._sizes:
            n = self.cluster.num_devices
            need = sum(self.roles[r].state_bytes for r in roles)
            floor = math.ceil(need / self.cluster.device.usable_bytes)
            sizes = allowed_sizes(n, self.cluster.devices_per_node)
            self._sizes[key] = [k for k in sizes if k >= floor and self.pool(key, k) is not None]
        return self._sizes[key]

    def min_devices(self, roles: Sequence[str]) -> int | None:
        """``A_min`` of a colocated set, or ``None`` if it fits on no allowed count."""
        sizes = self.pool_sizes(roles)
        return sizes[0] if sizes else None

    # ------------------------------------------------------------------ errors
    def check_fits(self) -> None:
        """Raise ``ValueError`` naming the first model that fits nowhere on the cluster."""
        n = self.cluster.num_devices
        for role in self.dataflow.roles:
            if self.pool((role,), n) is None:
                raise ValueError(too_big(self.roles[role], self.cluster, self.workload))

    # ------------------------------------------------------------------ Algorithm 1
    def plan(
        self, top_k: int = 3, placements: Iterable[Sequence[Sequence[str]]] | None = None
    ) -> list[Plan]:
        """The ``top_k`` best placements, best first, each with its best allocation.

        ``placements`` restricts the search (e.g. to the paper's colocate / split /
        standalone baselines); by default every set partition of the roles is tried.
        """
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.check_fits()
        n, per_node = self.cluster.num_devices, self.cluster.devices_per_node
        best: list[tuple[float, tuple[tuple[str, ...], ...], tuple[int, ...]]] = []
        todo = set_partitions(self.dataflow.roles) if placements is None else placements
        for placement in todo:
            sets = self._canonical(placement)
            options = [self.pool_sizes(s) for s in sets]
            if any(not o for o in options) or sum(o[0] for o in options) > n:
                continue  # some set fits nowhere, or the minima alone overflow the cluster
            found: tuple[float, tuple[int, ...]] | None = None
            for alloc in allocations(options, n, per_node):
                self.allocations_scored += 1
                pools = [self._pools[(s, k)] for s, k in zip(sets, alloc, strict=True)]
                _, total = combine((p.stage_seconds for p in pools if p), self.stages)
                if found is None or total < found[0] * (1 - 1e-12):
                    found = (total, alloc)
            if found is not None:
                best.append((found[0], sets, found[1]))
        if not best:
            raise ValueError(nothing_fits(list(self.roles.values()), self.cluster))
        best.sort(key=lambda item: item[0])
        return [self._build(sets, alloc) for _, sets, alloc in best[:top_k]]

    def _canonical(self, placement: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
        """Validate a placement and order roles as the dataflow does (stable cache keys)."""
        order = {r: i for i, r in enumerate(self.dataflow.roles)}
        flat = [r for s in placement for r in s]
        if sorted(flat) != sorted(order) or any(not s for s in placement):
            raise ValueError(
                f"placement {placement} must partition the roles {list(self.dataflow.roles)}"
            )
        sets = [tuple(sorted(s, key=order.__getitem__)) for s in placement]
        return tuple(sorted(sets, key=lambda s: order[s[0]]))

    def _build(self, sets: tuple[tuple[str, ...], ...], alloc: tuple[int, ...]) -> Plan:
        """Turn a scored (placement, allocation) into a :class:`Plan`."""
        slots = assign_nodes(alloc, self.cluster.devices_per_node, self.cluster.nodes)
        assert slots is not None  # allocations() only yields packable ones
        pools = []
        for roles, devices, slot in zip(sets, alloc, slots, strict=True):
            result = self._pools[(roles, devices)]
            assert result is not None
            models = []
            for role in roles:
                c, rm = result.choices[role], self.roles[role]
                gen = GenerationLayout(pp=1, tp=c.gen_tp) if c.gen_tp else None
                est = result.generation if gen else None
                models.append(
                    ModelPlan(
                        role=role,
                        model=rm.spec.name,
                        params=rm.spec.num_params,
                        trained=rm.trained,
                        devices=devices,
                        layout=c.layout,
                        generation=gen,
                        persistent_bytes=c.persistent,
                        transient_bytes=c.transient,
                        stage_seconds=result.model_seconds[role],
                        transition_seconds=c.transition,
                        generation_waves=est.waves if est else None,
                        generation_bytes=c.gen_weights + est.kv_bytes if est else 0.0,
                    )
                )
            pools.append(
                PoolPlan(
                    roles=roles,
                    devices=devices,
                    node_slots=tuple(slot),
                    models=tuple(models),
                    stage_seconds=result.stage_seconds,
                    peak_bytes=result.peak_bytes,
                    usable_bytes=self.cluster.device.usable_bytes,
                )
            )
        per_stage, total = combine((p.stage_seconds for p in pools), self.stages)
        return Plan(
            algorithm=self.dataflow.name,
            cluster=self.cluster,
            workload=self.workload,
            pools=tuple(pools),
            stage_seconds=per_stage,
            iteration_seconds=total,
        )


def plan(
    dataflow: Dataflow | str,
    models: Mapping[str, ModelSource],
    workload: Workload | Mapping[str, Any] | None,
    cluster: DeviceCluster,
    top_k: int = 3,
    placements: Iterable[Sequence[Sequence[str]]] | None = None,
    parallelism: Mapping[str, RoleParallelism] | None = None,
) -> list[Plan]:
    """Auto-map ``dataflow`` onto ``cluster``: the ``top_k`` best plans, best first.

    ``parallelism`` (per role, optional) restricts each role to layouts its engines can run.
    """
    planner = Planner(dataflow, models, workload, cluster, parallelism)
    return planner.plan(top_k=top_k, placements=placements)
