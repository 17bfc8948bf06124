"""Costing one colocated set: its models share devices, so their strategies are chosen together.

Each model brings its Algorithm-2 strategies (a time/memory Pareto front; all strategies for the
generator).  Resident state of every model stays on the devices, transients take turns, and the
generator's KV cache gets whatever memory is left -- so a leaner critic can buy the actor fewer
generation waves.  A small local search walks the fronts from the fastest combination.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hf_core.planner.autoparallel import Candidate, RoleModel
from hf_core.planner.devices import DeviceCluster
from hf_core.planner.simulator import GenerationEstimate, generate
from hf_core.planner.workload import Workload


@dataclass(frozen=True)
class PoolResult:
    """A colocated set costed on ``devices``: the strategy chosen for each of its models."""

    roles: tuple[str, ...]
    devices: int
    choices: Mapping[str, Candidate]
    generation: GenerationEstimate | None
    model_seconds: Mapping[str, Mapping[str, float]]
    stage_seconds: Mapping[str, float]
    busy: float
    resident_bytes: float
    peak_bytes: float


@dataclass(frozen=True)
class _State:
    """A combination of strategies inside a set, as the local search sees it."""

    feasible: bool
    cost: float
    overflow: float
    generator: Candidate | None = None
    generation: GenerationEstimate | None = None

    def better_than(self, other: _State) -> bool:
        """Feasible beats infeasible; then lower cost, or for infeasible ones less overflow."""
        if self.feasible != other.feasible:
            return self.feasible
        if self.feasible:
            return self.cost < other.cost * (1 - 1e-12)
        return self.overflow < other.overflow


class PoolCoster:
    """Choose the strategies of one colocated set on a device count (see :func:`cost_pool`)."""

    def __init__(
        self,
        fronts: Mapping[str, list[Candidate]],
        generator: RoleModel | None,
        workload: Workload,
        cluster: DeviceCluster,
    ) -> None:
        self.fronts = fronts
        self.generator = generator
        self.gen_role = generator.role if generator else None
        self.others = [r for r in fronts if r != self.gen_role]
        self.workload = workload
        self.cluster = cluster
        self.sequences = 0
        if generator is not None:
            extra = max(op.extra_per_prompt for _, op in generator.ops if op.kind == "generate")
            self.sequences = workload.sequences(extra)

    def run(self, roles: tuple[str, ...], devices: int, stages: Sequence[str]) -> PoolResult | None:
        """Local search from each model's fastest strategy; ``None`` if nothing fits."""
        index = dict.fromkeys(self.others, 0)
        state = self._evaluate(index)
        while True:
            step = self._improve(index, state)
            if step is None:
                break
            index, state = step
        if not state.feasible:
            return None
        return self._pool_result(roles, devices, stages, index, state)

    def _improve(
        self,
        index: dict[str, int],
        state: _State,
    ) -> tuple[dict[str, int], _State] | None:
        """One local-search move along the Pareto fronts, or ``None`` at a local optimum.

        Any model may jump to any slower, leaner strategy; the cheapest feasible result wins.
        While nothing is feasible, the single step that most reduces the memory overflow is
        taken even on a plateau (indices only grow, so the search ends).
        """
        best: tuple[dict[str, int], _State] | None = None
        step: tuple[dict[str, int], _State] | None = None
        for role in self.others:
            for j in range(index[role] + 1, len(self.fronts[role])):
                trial = {**index, role: j}
                result = self._evaluate(trial)
                if result.feasible and (best is None or result.cost < best[1].cost):
                    best = (trial, result)
                if j == index[role] + 1 and not result.feasible:
                    key = (result.overflow, result.cost)
                    if step is None or key < (step[1].overflow, step[1].cost):
                        step = (trial, result)
        if state.feasible:
            return best if best is not None and best[1].better_than(state) else None
        if best is not None:
            return best
        if step is not None and step[1].overflow <= state.overflow:
            return step
        return None

    def _evaluate(
        self,
        index: Mapping[str, int],
    ) -> _State:
        """Cost and memory of one combination; the generator picks its best strategy for the
        memory the others leave (everyone's resident state stays, transients do not)."""
        budget = self.cluster.device.usable_bytes
        chosen = [self.fronts[r][index[r]] for r in self.others]
        resident = sum(c.persistent for c in chosen)
        transient = max((c.transient for c in chosen), default=0.0)
        busy = sum(c.busy for c in chosen)
        if self.generator is None:
            overflow = resident + transient - budget
            return _State(overflow <= 0, busy, max(overflow, 0.0))
        spec = self.generator.spec
        best: _State | None = None
        least = math.inf
        for g in self.fronts[self.generator.role]:
            held = resident + g.persistent
            overflow = held + max(transient, g.transient, g.generation_floor) - budget
            if overflow > 0:
                least = min(least, overflow)
                continue
            free = budget - held - g.gen_weights
            est = generate(
                spec, g.layout, g.gen_tp or 1, self.workload, self.cluster, self.sequences, free
            )
            if est is None:
                continue
            cost = busy + g.busy + g.transition + est.seconds
            if best is None or cost < best.cost:
                best = _State(True, cost, 0.0, g, est)
        return best or _State(False, math.inf, least)

    def _pool_result(
        self,
        roles: tuple[str, ...],
        devices: int,
        stages: Sequence[str],
        index: Mapping[str, int],
        state: _State,
    ) -> PoolResult:
        """Freeze the chosen strategies with their per-stage seconds and peak memory."""
        choices = {r: self.fronts[r][index[r]] for r in index}
        seconds = {r: dict(c.stage_seconds) for r, c in choices.items()}
        peak_transient = max((c.transient for c in choices.values()), default=0.0)
        if state.generator is not None and state.generation is not None:
            g = state.generator
            choices[g.role] = g
            assert self.generator is not None
            gen_stage = next(s for s, op in self.generator.ops if op.kind == "generate")
            seconds[g.role] = dict(g.stage_seconds)
            seconds[g.role][gen_stage] = (
                seconds[g.role].get(gen_stage, 0.0) + g.transition + state.generation.seconds
            )
            peak_transient = max(
                peak_transient, g.transient, g.gen_weights + state.generation.kv_bytes
            )
        ordered = {r: choices[r] for r in roles}
        resident = sum(c.persistent for c in ordered.values())
        per_stage = {s: sum(seconds[r].get(s, 0.0) for r in roles) for s in stages}
        return PoolResult(
            roles=roles,
            devices=devices,
            choices=ordered,
            generation=state.generation,
            model_seconds={r: seconds[r] for r in roles},
            stage_seconds=per_stage,
            busy=sum(per_stage.values()),
            resident_bytes=resident,
            peak_bytes=resident + peak_transient,
        )


def cost_pool(
    roles: tuple[str, ...],
    devices: int,
    fronts: Mapping[str, list[Candidate]],
    generator: RoleModel | None,
    workload: Workload,
    cluster: DeviceCluster,
    stages: Sequence[str],
) -> PoolResult | None:
    """The best joint strategy of a colocated set, or ``None`` when it cannot fit.

    Start from each model's fastest strategy; while the set does not fit, or while trading one
    model's speed for memory buys the generator more KV cache (fewer waves) and a lower total,
    move one model along its time/memory Pareto front.  The generator re-picks its best layout
    and ``t_g`` for the memory left at every step.
    """
    return PoolCoster(fronts, generator, workload, cluster).run(roles, devices, stages)
