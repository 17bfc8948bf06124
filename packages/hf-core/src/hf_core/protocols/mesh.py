"""The parallel coordinates a worker reports so 3D transfer protocols work for any layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_core.resharding import ParallelLayout

TRAINING_AXES = ("dp_rank", "dp_size", "tp_rank", "tp_size", "pp_rank", "pp_size")
"""The training-mesh fields; each has a ``gen_`` twin for the generation mesh."""


@dataclass(frozen=True)
class WorkerMesh:
    """A rank's place in its training mesh, and optionally in the generation mesh.

    A pure data-parallel group (the default) is ``dp_rank = rank``, ``dp_size = world``.
    Engines with tensor or pipeline parallelism call :meth:`hf_core.worker.Worker.set_mesh`
    once their process groups exist.  ``gen_*`` describe the rollout layout of the
    3D-HybridEngine (``gen_dp`` counts every generation replica, micro-DP included).
    """

    dp_rank: int
    dp_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1
    """Sequence-parallel ranks (Ulysses): they share one data chunk and split its tokens."""
    gen_dp_rank: int | None = None
    gen_dp_size: int | None = None
    gen_tp_rank: int = 0
    gen_tp_size: int = 1
    gen_pp_rank: int = 0
    gen_pp_size: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "sp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{axis}_rank={rank} is outside {axis}_size={size}")

    @property
    def is_collect_rank(self) -> bool:
        """The rank whose output stands for its TP/PP/SP group: TP and SP rank 0 on the last
        PP stage."""
        return self.tp_rank == 0 and self.sp_rank == 0 and self.pp_rank == self.pp_size - 1

    def generation(self) -> WorkerMesh:
        """This rank's generation mesh as a mesh of its own (for 3D_ALL_MICRO_DP).

        Without a reported generation mesh, generation uses the training layout.
        """
        if self.gen_dp_rank is None or self.gen_dp_size is None:
            return self
        return WorkerMesh(**{axis: getattr(self, f"gen_{axis}") for axis in TRAINING_AXES})

    @classmethod
    def of_layout(cls, layout: ParallelLayout, rank: int) -> WorkerMesh:
        """``rank``'s training coordinates in a (pp, tp, dp) layout (no generation mesh)."""
        c = layout.coords(rank)
        return cls(c.dp, layout.dp, c.tp, layout.tp, c.pp, layout.pp)
