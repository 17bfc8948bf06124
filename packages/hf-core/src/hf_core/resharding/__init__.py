"""3D-HybridEngine reshard plans (HybridFlow §5.4): pure Python, no torch or Ray.

``layout`` names the meshes and shards; ``plan`` says, per rank, whom to all-gather with and
what each rank holds for generation.  Backends turn a :class:`RankPlan` into collectives.
"""

from hf_core.resharding.layout import GenerationLayout, MeshCoord, ParallelLayout, Shard, Unit
from hf_core.resharding.plan import (
    RankPlan,
    ReshardPlan,
    build_hybrid_plan,
    build_naive_plan,
    ds_chat_volume_fraction,
    hybrid_engine_volume_fraction,
    naive_volume_fraction,
)
from hf_core.resharding.report import ReshardReport, expected_received_bytes

__all__ = [
    "GenerationLayout",
    "MeshCoord",
    "ParallelLayout",
    "RankPlan",
    "ReshardPlan",
    "ReshardReport",
    "Shard",
    "Unit",
    "build_hybrid_plan",
    "build_naive_plan",
    "ds_chat_volume_fraction",
    "expected_received_bytes",
    "hybrid_engine_volume_fraction",
    "naive_volume_fraction",
]
