"""Algorithm 2 (``auto_parallel``): the parallel strategies of one model on ``n`` devices.

Every ``(t, p, d)`` with ``t p d = n`` is tried, ``t`` inside a node (``t`` divides the node,
the heads and the KV heads' grouping) and ``p`` dividing the layers; for the generating model
each generation TP size ``t_g`` dividing ``t`` is tried too (``p_g = 1``: the rollout engine
runs no pipeline).  Strategies whose own memory does not fit one device are dropped here; the
search then combines colocated models' strategies under their shared memory budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hf_core.planner.dataflow import Op
from hf_core.planner.devices import DeviceCluster
from hf_core.planner.memory import (
    generation_weight_bytes,
    infer_activation_bytes,
    kv_bytes_per_token,
    persistent_bytes,
    state_bytes,
    train_activation_bytes,
)
from hf_core.planner.models import ModelSpec
from hf_core.planner.simulator import infer_seconds, train_seconds, transition_seconds
from hf_core.planner.workload import Workload
from hf_core.resharding import ParallelLayout


@dataclass(frozen=True)
class RoleModel:
    """A role of the dataflow bound to its model and its operations ``(stage, op)``."""

    role: str
    spec: ModelSpec
    ops: tuple[tuple[str, Op], ...]

    @property
    def trained(self) -> bool:
        """Trained roles keep gradients and Adam states resident."""
        return any(op.kind == "train" for _, op in self.ops)

    @property
    def generates(self) -> bool:
        """The generating role also needs a generation layout and a reshard."""
        return any(op.kind == "generate" for _, op in self.ops)

    @property
    def state_bytes(self) -> float:
        """Unsharded persistent bytes (16 or 2 per parameter): ``get_min_alloc``'s input."""
        return state_bytes(self.spec, self.trained)


@dataclass(frozen=True)
class Candidate:
    """One strategy of one model on ``n`` devices, with everything the search needs.

    ``stage_seconds`` covers the forward and training work; generation time depends on how
    much memory the colocated models leave, so the search adds it (see :mod:`search`).
    """

    role: str
    layout: ParallelLayout
    gen_tp: int | None
    persistent: float
    transient: float
    stage_seconds: Mapping[str, float] = field(hash=False)
    transition: float = 0.0
    gen_weights: float = 0.0
    """Extra weight bytes resident while generating (the gathered generation shard)."""
    kv_per_sequence: float = 0.0

    @property
    def busy(self) -> float:
        """Seconds of forward and training work, summed over stages."""
        return sum(self.stage_seconds.values())

    @property
    def generation_floor(self) -> float:
        """Least transient memory generation needs: the shard plus one sequence's KV cache."""
        return self.gen_weights + self.kv_per_sequence


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    return [k for k in range(1, n + 1) if n % k == 0]


def tensor_sizes(spec: ModelSpec, n: int, per_node: int) -> list[int]:
    """TP sizes that stay inside a node and split heads evenly (Megatron's requirement that
    ``t`` divide the query groups, or be a multiple of them so KV heads replicate)."""
    sizes = []
    for t in _divisors(n):
        if t > per_node or per_node % t or spec.num_heads % t:
            continue
        if spec.num_kv_heads % t and t % spec.num_kv_heads:
            continue
        sizes.append(t)
    return sizes


def layouts(spec: ModelSpec, n: int, per_node: int) -> list[ParallelLayout]:
    """All training layouts ``(t, p, d)`` of ``n`` devices the model can use."""
    out = []
    for t in tensor_sizes(spec, n, per_node):
        for p in _divisors(n // t):
            if spec.num_layers % p == 0:
                out.append(ParallelLayout(pp=p, tp=t, dp=n // (t * p)))
    return out


def auto_parallel(
    role: RoleModel, n: int, workload: Workload, cluster: DeviceCluster
) -> list[Candidate]:
    """Feasible strategies of ``role`` on ``n`` devices, fastest forward/training work first.

    A strategy is dropped when the model alone would not fit a device: its resident state plus
    its largest transient (activations, or the generation shard and one sequence of KV cache).
    """
    budget = cluster.device.usable_bytes
    spec = role.spec
    out: list[Candidate] = []
    for layout in layouts(spec, n, cluster.devices_per_node):
        resident = persistent_bytes(spec, layout, role.trained, workload.distributed_optimizer)
        transient = 0.0
        seconds: dict[str, float] = {}
        for stage, op in role.ops:
            sequences = workload.sequences(op.extra_per_prompt)
            if op.kind == "train":
                transient = max(transient, train_activation_bytes(spec, layout, workload))
                cost = train_seconds(spec, layout, workload, cluster, sequences)
            elif op.kind == "infer":
                transient = max(transient, infer_activation_bytes(spec, layout, workload))
                cost = infer_seconds(spec, layout, workload, cluster, sequences)
            else:
                continue
            seconds[stage] = seconds.get(stage, 0.0) + cost
        if resident + transient > budget:
            continue
        if not role.generates:
            out.append(Candidate(role.role, layout, None, resident, transient, seconds))
            continue
        for tg in _divisors(layout.tp):
            if spec.num_heads % tg:
                continue
            gen_weights = generation_weight_bytes(spec, layout, tg)
            kv_seq = kv_bytes_per_token(spec, tg) * workload.sequence_length
            if resident + gen_weights + kv_seq > budget:
                continue
            out.append(
                Candidate(
                    role.role,
                    layout,
                    tg,
                    resident,
                    transient,
                    seconds,
                    transition=transition_seconds(spec, layout, tg, cluster),
                    gen_weights=gen_weights,
                    kv_per_sequence=kv_seq,
                )
            )
    out.sort(key=lambda c: (c.busy, c.persistent, c.layout.tp, c.layout.pp))
    return out


def pareto(candidates: list[Candidate]) -> list[Candidate]:
    """Strategies not beaten on time, resident and transient memory at once, fastest first:
    the only ones worth trading when colocated models compete for memory."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.busy, c.persistent, c.transient)):
        if all(c.persistent < f.persistent or c.transient < f.transient for f in front):
            front.append(c)
    return front
