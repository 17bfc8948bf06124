"""megatron's process groups, this rank's coordinates, and the mesh core's protocols read.

megatron keeps its TP/PP/DP groups in module globals, so every megatron engine in one process
shares one layout (colocated actor, reference and critic must agree on ``tp`` and ``pp``).
Building an engine with another layout re-initialises the groups; engines built under the
old layout must not be used afterwards (:func:`ensure_model_parallel` logs when it happens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch.distributed as dist

from hf_core.protocols import WorkerMesh
from hf_core.resharding import ParallelLayout, ReshardPlan

log = logging.getLogger(__name__)

MEGATRON_ORDER = "tp-dp-pp"
"""megatron's rank order (``tp-cp-ep-dp-pp`` with cp = ep = 1), fastest axis first."""

_GENERATION = 0  # bumped on every re-initialisation; engines compare it before running


@dataclass(frozen=True)
class MegatronLayout:
    """This rank's place in the (pp, tp, dp) training mesh."""

    layout: ParallelLayout
    rank: int
    generation: int

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def coords(self):
        return self.layout.coords(self.rank)


def ensure_model_parallel(tp: int, pp: int, seed: int) -> MegatronLayout:
    """Initialise megatron's groups for ``tp`` x ``pp`` (dp = world / (tp pp)), or reuse them."""
    global _GENERATION
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}")
    current = ps.model_parallel_is_initialized() and (
        ps.get_tensor_model_parallel_world_size() == tp
        and ps.get_pipeline_model_parallel_world_size() == pp
    )
    if not current:
        if ps.model_parallel_is_initialized():
            log.warning(
                "re-initialising megatron's process groups for tp=%d pp=%d: engines built "
                "with the previous layout in this process can no longer be used",
                tp,
                pp,
            )
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        _GENERATION += 1
    layout = ParallelLayout(pp=pp, tp=tp, dp=world // (tp * pp), order=MEGATRON_ORDER)
    rank = dist.get_rank()
    coords = layout.coords(rank)
    actual = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )
    if tuple(coords) != actual:
        raise RuntimeError(
            f"megatron placed rank {rank} at (pp, tp, dp) = {actual}, but the layout "
            f"{layout} says {tuple(coords)}: megatron's rank order changed"
        )
    return MegatronLayout(layout, rank, _GENERATION)


def current_generation() -> int:
    return _GENERATION


def worker_mesh(layout: MegatronLayout, plan: ReshardPlan | None = None) -> WorkerMesh:
    """The mesh a worker reports with ``Worker.set_mesh`` (3D_PROTO, 3D_ALL_MICRO_DP).

    With a reshard plan the generation mesh is included: every micro-DP replica is a
    generation DP rank (``gen_dp = dp * d_g``), TP/PP ranks as the plan assigns them.
    """
    mesh = WorkerMesh.of_layout(layout.layout, layout.rank)
    if plan is None:
        return mesh
    rp = plan.for_rank(layout.rank)
    d_g = plan.gen.micro_dp_size(plan.train)
    return replace(
        mesh,
        gen_dp_rank=layout.coords.dp * d_g + rp.micro_dp_rank,
        gen_dp_size=layout.dp * d_g,
        gen_tp_rank=rp.gen_tp_rank,
        gen_tp_size=plan.gen.tp,
        gen_pp_rank=rp.gen_pp_rank,
        gen_pp_size=plan.gen.pp,
    )
