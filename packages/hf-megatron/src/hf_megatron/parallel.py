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
"""megatron's rank order of the dense layers (``tp-cp-dp-pp`` with cp = 1), fastest axis
first.  Expert parallelism does not change it: megatron lays the expert layers out as
``etp-ep-edp-pp`` with the expert TP size equal to TP, so ``ep`` splits the data-parallel
axis: expert-parallel rank ``dp % ep``, expert data-parallel rank ``dp // ep``."""

_GENERATION = 0  # bumped on every re-initialisation; engines compare it before running


@dataclass(frozen=True)
class MegatronLayout:
    """This rank's place in the (pp, tp, dp) training mesh."""

    layout: ParallelLayout
    rank: int
    generation: int
    ep: int = 1
    """Expert-parallel size (divides ``dp``); 1 for a dense model."""

    @property
    def ep_rank(self) -> int:
        return self.coords.dp % self.ep

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


def check_expert_parallel(world: int, tp: int, pp: int, ep: int) -> None:
    """megatron's rule for ``ep``: it splits the data-parallel axis, so ``tp * pp * ep`` must
    divide the world size (expert TP is TP)."""
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}")
    dp = world // (tp * pp)
    if dp % ep:
        raise ValueError(
            f"ep={ep} must divide the data-parallel size {dp} (world {world} / (tp={tp} * "
            f"pp={pp})): megatron places expert parallelism inside data parallelism"
        )


def ensure_model_parallel(tp: int, pp: int, seed: int, ep: int = 1) -> MegatronLayout:
    """Initialise megatron's groups for ``tp`` x ``pp`` (dp = world / (tp pp)) with ``ep``
    expert-parallel ranks inside dp, or reuse them."""
    global _GENERATION
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    check_expert_parallel(world, tp, pp, ep)
    current = ps.model_parallel_is_initialized() and (
        ps.get_tensor_model_parallel_world_size() == tp
        and ps.get_pipeline_model_parallel_world_size() == pp
        and ps.get_expert_model_parallel_world_size() == ep
    )
    if not current:
        if ps.model_parallel_is_initialized():
            log.warning(
                "re-initialising megatron's process groups for tp=%d pp=%d ep=%d: engines "
                "built with the previous layout in this process can no longer be used",
                tp,
                pp,
                ep,
            )
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
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
    placed = MegatronLayout(layout, rank, _GENERATION, ep)
    if ps.get_expert_model_parallel_rank() != placed.ep_rank:
        raise RuntimeError(
            f"megatron placed rank {rank} at expert-parallel rank "
            f"{ps.get_expert_model_parallel_rank()}, the layout says {placed.ep_rank}"
        )
    return placed


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
