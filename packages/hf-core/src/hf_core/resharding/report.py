"""What one 3D-HybridEngine transition moved, next to what the paper says it should move.

A resharding training engine fills a :class:`ReshardReport` per weight sync; core compares it
with :func:`expected_received_bytes` (HybridFlow Table 2 for the plan in use) and logs both.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_core.resharding.plan import ReshardPlan, hybrid_engine_volume, naive_volume


@dataclass(frozen=True)
class ReshardReport:
    """One rank's transition, measured (bytes are of the training dtype)."""

    kind: str
    """The plan: ``hybrid`` (the paper's) or ``naive`` (HybridFlow-V)."""
    received_bytes: int
    """Bytes of other ranks' training shards that landed in this rank's buffers."""
    model_bytes: int
    """``M`` as the all-gathers move it (``p * t`` equal units, padding included)."""
    peak_extra_bytes: int
    """Largest sum of live transition buffers beyond the training parameters themselves."""
    zero_redundancy: bool
    """Own shard inside the generation shard, and nothing gathered beyond it."""
    seconds: float = 0.0
    expert_received_bytes: int = 0
    """Expert parallelism: other ranks' experts received in the experts' own phase (not in
    ``received_bytes``, which counts the plan's units)."""


def expected_received_bytes(plan: ReshardPlan, model_bytes: int) -> int:
    """Per-rank received volume of ``plan`` for a model of ``model_bytes`` (Table 2):
    ``(pt - t_g p_g) / (t_g p_g pt) M`` for the paper's plan, ``(pt - 1) / pt M`` naive."""
    fraction = (
        hybrid_engine_volume(plan.train, plan.gen)
        if plan.kind == "hybrid"
        else naive_volume(plan.train)
    )
    expected = fraction * model_bytes
    if expected.denominator != 1:
        units = plan.train.model_parallel_size
        raise ValueError(f"{model_bytes} bytes do not split into {units} equal training units")
    return int(expected)
