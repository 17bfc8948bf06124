"""Transfer protocols (HybridFlow §4.2): dispatch / collect declared per worker method."""

from hf_core.lazy_imports import reexports
from hf_core.protocols.decorator import MethodSpec as MethodSpec
from hf_core.protocols.decorator import register as register
from hf_core.protocols.decorator import registered_methods as registered_methods
from hf_core.protocols.mesh import WorkerMesh as WorkerMesh
from hf_core.protocols.transfer import ALL_TO_ALL as ALL_TO_ALL
from hf_core.protocols.transfer import BUILTIN_PROTOCOLS as BUILTIN_PROTOCOLS
from hf_core.protocols.transfer import DP_PROTO as DP_PROTO
from hf_core.protocols.transfer import ONE_TO_ALL as ONE_TO_ALL
from hf_core.protocols.transfer import RANK_ZERO as RANK_ZERO
from hf_core.protocols.transfer import THREE_D_ALL_MICRO_DP as THREE_D_ALL_MICRO_DP
from hf_core.protocols.transfer import THREE_D_PP_ONLY as THREE_D_PP_ONLY
from hf_core.protocols.transfer import THREE_D_PROTO as THREE_D_PROTO
from hf_core.protocols.transfer import GroupContext as GroupContext
from hf_core.protocols.transfer import TransferProtocol as TransferProtocol
from hf_core.protocols.transfer import broadcast as broadcast
from hf_core.protocols.transfer import concat_outputs as concat_outputs
from hf_core.protocols.transfer import split_batches as split_batches
from hf_core.protocols.transfer import split_per_rank as split_per_rank

__all__ = sorted(reexports(__name__))
