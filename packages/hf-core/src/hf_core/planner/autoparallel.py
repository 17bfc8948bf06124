"""Algorithm 2 (``auto_parallel``): the parallel strategies of one model on ``n`` devices.

Every ``(t, p, d)`` with ``t p d = n`` is tried, ``t`` inside a node (``t`` divides the node,
the heads and the KV heads' grouping) and ``p`` dividing the layers; for the generating model
each generation TP size ``t_g`` dividing ``t`` is tried too (``p_g = 1``: the rollout engine
runs no pipeline).  Strategies whose own memory does not fit one device are dropped here; the
search then combines colocated models' strategies under their shared memory budget.

A role's :class:`RoleParallelism` narrows the search to what the engines running it can do
(the axes a backend declares, sizes a user fixed); its default allows everything, which is the
paper's unconstrained search.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

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

Axis = Literal["tp", "pp"]
AXES: frozenset[str] = frozenset({"tp", "pp"})
"""The model-parallel axes the planner sizes (data parallelism takes the remaining ranks)."""


@dataclass(frozen=True)
class RoleParallelism:
    """What the engines running one role can run: the planner proposes nothing else.

    ``axes``: model-parallel axes of the training (and forward) engine; without ``tp`` the
    role gets ``t = 1``, without ``pp`` ``p = 1``, so a data-parallel-only engine (FSDP) uses
    all of its pool's ranks as ``d``.  ``generation_axes``: axes of the rollout engine (the
    generating role only); without ``tp``, ``t_g = 1``.  When the training engine is
    model-parallel (any axis), ``t_g`` must divide ``t`` (the 3D-HybridEngine reshard, Table 2);
    a data-parallel one exports whole tensors, so ``t_g`` need only divide the pool's ranks.
    ``tp`` / ``pp`` / ``generation_tp`` fix a size (a user's explicit setting).
    ``shared_layout``: roles with the same key placed in one pool must get the same ``(t, p)``
    (engines keeping their process groups in process-wide state, e.g. megatron-core).

    The default allows every layout: the paper's unconstrained search.
    """

    axes: frozenset[str] = AXES
    generation_axes: frozenset[str] = frozenset({"tp"})
    tp: int | None = None
    pp: int | None = None
    generation_tp: int | None = None
    shared_layout: str | None = None

    def __post_init__(self) -> None:
        bad = sorted((set(self.axes) | set(self.generation_axes)) - AXES)
        if bad:
            raise ValueError(f"unknown parallel axes {bad}; expected a subset of {sorted(AXES)}")
        for axis, size in (("tp", self.tp), ("pp", self.pp)):
            if size is not None and size < 1:
                raise ValueError(f"fixed {axis} size must be >= 1, got {size}")
            if size is not None and size > 1 and axis not in self.axes:
                raise ValueError(
                    f"{axis}={size} is fixed, but the engine supports only {sorted(self.axes)}"
                )
        tg = self.generation_tp
        if tg is not None and (tg < 1 or (tg > 1 and "tp" not in self.generation_axes)):
            raise ValueError(
                f"generation tp={tg} is fixed, but the rollout engine supports only "
                f"{sorted(self.generation_axes)}"
            )

    @property
    def model_parallel(self) -> bool:
        """Whether the training engine shards the model itself (then ``t_g | t``)."""
        return bool(self.axes)

    def sizes(self, axis: Axis, options: list[int]) -> list[int]:
        """``options`` narrowed to what this role may use on ``axis``."""
        fixed = self.tp if axis == "tp" else self.pp
        if axis not in self.axes:
            options = [k for k in options if k == 1]
        return [k for k in options if fixed is None or k == fixed]


FREE = RoleParallelism()
"""No constraint: every layout the model's shape allows."""


@dataclass(frozen=True)
class RoleModel:
    """A role of the dataflow bound to its model and its operations ``(stage, op)``."""

    role: str
    spec: ModelSpec
    ops: tuple[tuple[str, Op], ...]
    parallelism: RoleParallelism = FREE

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


def layouts(
    spec: ModelSpec, n: int, per_node: int, parallelism: RoleParallelism = FREE
) -> list[ParallelLayout]:
    """All training layouts ``(t, p, d)`` of ``n`` devices the model and its engine can use."""
    out = []
    for t in parallelism.sizes("tp", tensor_sizes(spec, n, per_node)):
        stages = [p for p in _divisors(n // t) if spec.num_layers % p == 0]
        for p in parallelism.sizes("pp", stages):
            out.append(ParallelLayout(pp=p, tp=t, dp=n // (t * p)))
    return out


def generation_sizes(
    spec: ModelSpec, layout: ParallelLayout, per_node: int, parallelism: RoleParallelism = FREE
) -> list[int]:
    """Generation TP sizes ``t_g`` the rollout engine can take next to ``layout``.

    A model-parallel training engine reshards its ``t``-way slices, so ``t_g | t``; a
    data-parallel one hands over whole tensors, which a TP rollout can slice any way that
    suits the heads, inside a node, over its ranks.
    """
    if "tp" not in parallelism.generation_axes:
        sizes = [1]
    elif parallelism.model_parallel:
        sizes = [tg for tg in _divisors(layout.tp) if spec.num_heads % tg == 0]
    else:
        sizes = tensor_sizes(spec, layout.world_size, per_node)
    fixed = parallelism.generation_tp
    return [tg for tg in sizes if fixed is None or tg == fixed]


def _transition(
    spec: ModelSpec, layout: ParallelLayout, gen_tp: int, cluster: DeviceCluster
) -> float:
    """Reshard seconds; zero when the training layout holds whole tensors (``t = p = 1``):
    every rank then slices its generation shard locally."""
    if layout.model_parallel_size == 1:
        return 0.0
    return transition_seconds(spec, layout, gen_tp, cluster)


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
    per_node = cluster.devices_per_node
    for layout in layouts(spec, n, per_node, role.parallelism):
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
        for tg in generation_sizes(spec, layout, per_node, role.parallelism):
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
                    transition=_transition(spec, layout, tg, cluster),
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
