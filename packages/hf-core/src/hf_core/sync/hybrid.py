"""In-process sync: one path from any training engine into the colocated rollout engine.

After an update the rollout engine in the same process needs the new weights (HybridFlow
§5.4). A model-parallel training engine (:class:`~hf_core.engines.ReshardsWeights`, e.g.
megatron's TP x PP) runs the 3D-HybridEngine transition for core's plan
(:mod:`hf_core.sync.plan`): each rank all-gathers only within its micro-DP group and streams
its generation shard -- whole tensors, or its TP slices when the rollout engine loads them
(:class:`~hf_core.engines.LoadsTPSlices`). A data-parallel engine (FSDP) streams whole
canonical tensors on every rank. Either way the transfer goes in buckets, so the extra
memory is about one bucket, never a second model."""

from __future__ import annotations

import time
from collections.abc import Iterable

from hf_core.engines import (
    CanonicalSlice,
    LoadsTPSlices,
    NamedTensor,
    ReshardsWeights,
    RolloutEngine,
    TrainingEngine,
)
from hf_core.resharding import GenerationLayout, expected_received_bytes
from hf_core.sync.plan import ReshardKind, build_plan, check_generation_rank


class HybridSync:
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
        generation: GenerationLayout | None = None,
    ) -> None:
        self.actor, self.rollout = actor, rollout
        self.bucket_bytes = bucket_bytes
        self.rank = rank
        self.plan = build_plan(actor, rollout, kind, generation)
        self.loads_slices = isinstance(rollout, LoadsTPSlices)
        if self.plan is not None:
            check_generation_rank(self.plan, rank, rollout)

    def run(self, version: int = 0) -> dict[str, float]:
        """One sync (``version`` is not needed in-process); this rank's ``perf/weight_sync_s``,
        ``reshard/*`` (when the actor reshards) and the rollout engine's ``weight_sync/*``."""
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
        experts = {"reshard/expert_bytes_received": float(report.expert_received_bytes)}
        return (experts if report.expert_received_bytes else {}) | {
            "reshard/bytes_received": float(report.received_bytes),
            "reshard/bytes_expected": float(expected_received_bytes(self.plan, report.model_bytes)),
            "reshard/model_bytes": float(report.model_bytes),
            "reshard/zero_redundancy": float(report.zero_redundancy),
            "reshard/peak_extra_bytes": float(report.peak_extra_bytes),
            "reshard/seconds": report.seconds,
        }
