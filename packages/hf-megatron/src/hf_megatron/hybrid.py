"""The hybrid engine's weight sync: training engine -> colocated rollout engine, in buckets."""

from __future__ import annotations

from typing import Any

from hf_core.engines import LoadsTPSlices, RolloutEngine
from hf_core.resharding import RankPlan, ReshardPlan
from hf_megatron.engine import MegatronEngine
from hf_megatron.reshard import ReshardStats


def accepts_slices(rollout: RolloutEngine) -> bool:
    """Whether ``rollout`` loads generation TP slices (:class:`CanonicalSlice`) itself: it
    declares so by implementing core's :class:`~hf_core.engines.LoadsTPSlices`."""
    return isinstance(rollout, LoadsTPSlices)


def hybrid_sync(
    engine: MegatronEngine,
    rollout: RolloutEngine,
    plan: RankPlan | ReshardPlan | None,
    bucket_bytes: int,
) -> ReshardStats:
    """Run the 3D-HybridEngine transition and stream its buckets into ``rollout``.

    A rollout engine that only takes whole canonical tensors (HF, vLLM through
    ``reload_weights``) needs a plan with generation TP size 1; one that
    :func:`accepts_slices` gets this rank's TP slices.  Every rank calls this together.
    """
    slices = accepts_slices(rollout)
    for bucket in engine.export_slices(bucket_bytes, plan):
        if slices:
            rollout.load_weights(bucket)
            continue
        partial: list[Any] = [s.name for s in bucket if not s.is_full]
        if partial:
            raise ValueError(
                f"{type(rollout).__name__} loads whole tensors, but the plan's generation TP "
                f"size gives slices ({partial[:3]}...): use t_g = 1 or a TP rollout engine"
            )
        rollout.load_weights([(s.name, s.tensor) for s in bucket])
    rollout.finish_weight_sync()
    assert engine.last_reshard is not None
    return engine.last_reshard
