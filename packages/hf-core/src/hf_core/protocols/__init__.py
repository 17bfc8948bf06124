"""Transfer protocols (HybridFlow §4.2): dispatch / collect declared per worker method."""

from hf_core.protocols.decorator import MethodSpec, register, registered_methods
from hf_core.protocols.mesh import WorkerMesh
from hf_core.protocols.transfer import (
    ALL_TO_ALL,
    BUILTIN_PROTOCOLS,
    DP_PROTO,
    ONE_TO_ALL,
    RANK_ZERO,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PP_ONLY,
    THREE_D_PROTO,
    GroupContext,
    TransferProtocol,
    broadcast,
    concat_outputs,
    split_batches,
    split_per_rank,
)

__all__ = [
    "ALL_TO_ALL",
    "BUILTIN_PROTOCOLS",
    "DP_PROTO",
    "ONE_TO_ALL",
    "RANK_ZERO",
    "THREE_D_ALL_MICRO_DP",
    "THREE_D_PP_ONLY",
    "THREE_D_PROTO",
    "GroupContext",
    "MethodSpec",
    "TransferProtocol",
    "WorkerMesh",
    "broadcast",
    "concat_outputs",
    "register",
    "registered_methods",
    "split_batches",
    "split_per_rank",
]
