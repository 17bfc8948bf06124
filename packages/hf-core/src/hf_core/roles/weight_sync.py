"""The actor's weight sync: one path from any training engine into any colocated rollout engine.

After an update the rollout engine in the same process needs the new weights (HybridFlow §5.4).
A model-parallel training engine (:class:`~hf_core.engines.ReshardsWeights`, e.g. megatron's
TP x PP) runs the 3D-HybridEngine transition for core's plan, built here from its training
layout ``(p, t, d)`` and the rollout engine's generation layout ``(p_g, t_g)``: each rank
all-gathers only within its micro-DP group and streams its generation shard -- whole tensors,
or its TP slices when the rollout engine loads them (:class:`~hf_core.engines.LoadsTPSlices`).
A data-parallel engine (FSDP) streams whole canonical tensors.  Either way the transfer goes in
buckets, so the extra memory is about one bucket, never a second model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Literal

from hf_core.engines import (
    CanonicalSlice,
    HasGenerationRank,
    LoadsTPSlices,
    NamedTensor,
    ReshardsWeights,
    RolloutEngine,
    TrainingEngine,
)
from hf_core.resharding import (
    GenerationLayout,
    ReshardPlan,
    build_hybrid_plan,
    build_naive_plan,
    expected_received_bytes,
)

ReshardKind = Literal["hybrid", "naive"]

WHOLE_MODEL = GenerationLayout(pp=1, tp=1)


def generation_layout(rollout: RolloutEngine) -> GenerationLayout:
    """``(p_g, t_g)`` of a rollout engine that loads TP slices; a whole-tensor engine needs
    the whole model on every rank (``p_g = t_g = 1``)."""
    return rollout.generation_layout() if isinstance(rollout, LoadsTPSlices) else WHOLE_MODEL


def build_plan(
    actor: TrainingEngine, rollout: RolloutEngine, kind: ReshardKind
) -> ReshardPlan | None:
    """Core's reshard plan for this pair, or ``None`` when the actor is data parallel."""
    if not isinstance(actor, ReshardsWeights):
        return None
    build = build_hybrid_plan if kind == "hybrid" else build_naive_plan
    train, gen = actor.parallel_layout(), generation_layout(rollout)
    try:
        return build(train, gen)
    except ValueError as exc:
        raise ValueError(
            f"{type(rollout).__name__}'s generation layout (p_g={gen.pp}, t_g={gen.tp}) cannot "
            f"be resharded from {type(actor).__name__}'s training layout (p={train.pp}, "
            f"t={train.tp}, d={train.dp}): t_g must divide t and p_g must divide p ({exc})"
        ) from None


def check_generation_rank(plan: ReshardPlan, rank: int, rollout: RolloutEngine) -> None:
    """The rollout engine's TP group must be the one the plan hands this rank's slices to."""
    if not isinstance(rollout, HasGenerationRank):
        return
    built = rollout.generation_rank()
    planned = plan.for_rank(rank)
    first = rank - built.tp_rank
    group = tuple(range(first, first + built.tp_size))
    if built.tp_size != plan.gen.tp or planned.gen_tp_group != group:
        raise RuntimeError(
            f"rank {rank}: the rollout engine's TP group {group} is not the plan's generation "
            f"TP group {planned.gen_tp_group}; the training layout's rank order must put "
            "each generation TP group on consecutive ranks"
        )


class WeightSync:
    """Streams one rank's weights from ``actor`` into ``rollout``; every rank calls
    :meth:`run` together (the transition's collectives run inside)."""

    def __init__(
        self,
        actor: TrainingEngine,
        rollout: RolloutEngine,
        *,
        bucket_bytes: int,
        kind: ReshardKind = "hybrid",
        rank: int = 0,
    ) -> None:
        self.actor, self.rollout = actor, rollout
        self.bucket_bytes = bucket_bytes
        self.rank = rank
        self.plan = build_plan(actor, rollout, kind)
        self.loads_slices = isinstance(rollout, LoadsTPSlices)
        if self.plan is not None:
            check_generation_rank(self.plan, rank, rollout)

    def run(self) -> dict[str, float]:
        """One sync; returns this rank's ``perf/weight_sync_s``, ``reshard/*`` (when the
        actor reshards) and the rollout engine's own ``weight_sync/*`` numbers."""
        start = time.perf_counter()
        if self.plan is None:
            for bucket in self.actor.export_weights(self.bucket_bytes):
                self.rollout.load_weights(bucket)
        else:
            assert isinstance(self.actor, ReshardsWeights)
            for slices in self.actor.export_slices(self.bucket_bytes, self.plan):
                self.rollout.load_weights(self._for_rollout(slices))
        self.rollout.finish_weight_sync()
        metrics = {"perf/weight_sync_s": time.perf_counter() - start}
        metrics.update(self._reshard_metrics())
        metrics.update(self.rollout.sync_metrics())
        return metrics

    def _for_rollout(self, slices: list[CanonicalSlice]) -> Iterable[NamedTensor]:
        """Slices as they are for a slice-loading engine; whole tensors for the others."""
        if self.loads_slices:
            return slices  # type: ignore[return-value]  # LoadsTPSlices engines take both
        partial = [s.name for s in slices if not s.is_full]
        if partial:
            raise RuntimeError(f"whole tensors expected with t_g = 1, got slices of {partial[:3]}")
        return [(s.name, s.tensor) for s in slices]

    def _reshard_metrics(self) -> dict[str, float]:
        if self.plan is None or not isinstance(self.actor, ReshardsWeights):
            return {}
        report = self.actor.last_reshard()
        if report is None:
            return {}
        return {
            "reshard/bytes_received": float(report.received_bytes),
            "reshard/bytes_expected": float(expected_received_bytes(self.plan, report.model_bytes)),
            "reshard/model_bytes": float(report.model_bytes),
            "reshard/zero_redundancy": float(report.zero_redundancy),
            "reshard/peak_extra_bytes": float(report.peak_extra_bytes),
            "reshard/seconds": report.seconds,
        }


def merge_rank_metrics(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """One row for the log from every rank's sync: zero redundancy only if on every rank,
    everything else the worst rank's (bytes and seconds: the maximum)."""
    merged: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key not in merged:
                merged[key] = value
            elif key == "reshard/zero_redundancy":
                merged[key] = min(merged[key], value)
            else:
                merged[key] = max(merged[key], value)
    return merged
