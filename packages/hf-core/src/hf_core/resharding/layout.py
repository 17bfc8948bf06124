"""Parallel layouts and model shards: the vocabulary of the 3D-HybridEngine (HybridFlow §5.4).

A training layout is a 3D mesh (pp, tp, dp); a generation layout keeps dp and shrinks tp/pp,
which frees a micro-DP axis inside each training DP replica (Fig. 8).  Shards are described
over abstract "units" -- one pipeline stage times one tensor-parallel slice of the training
layout -- so plans can be checked without tensors or a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

AXES: frozenset[str] = frozenset({"pp", "tp", "dp"})

Unit = tuple[int, int]
"""One training unit ``(pipeline stage, tensor-parallel slice)``; ``M / (p * t)`` of the model."""


class MeshCoord(NamedTuple):
    """A rank's position on the training mesh; a tuple so it unpacks as ``pp, tp, dp``."""

    pp: int
    tp: int
    dp: int


def _check_size(name: str, value: int) -> None:
    """Reject non-integer or non-positive parallel sizes before they poison rank arithmetic."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ParallelLayout:
    """A training layout of ``pp * tp * dp`` ranks.

    ``order`` names the axes fastest-varying first: the default ``"tp-pp-dp"`` makes every DP
    replica a contiguous block of ``pp * tp`` ranks; megatron's default is ``"tp-dp-pp"``.
    Any permutation of the three axes is accepted.
    """

    pp: int
    tp: int
    dp: int
    order: str = "tp-pp-dp"

    def __post_init__(self) -> None:
        """Validate sizes and order so every later rank computation can trust them."""
        for name in ("pp", "tp", "dp"):
            _check_size(name, getattr(self, name))
        axes = self.order.split("-") if isinstance(self.order, str) else []
        if len(axes) != 3 or set(axes) != AXES:
            raise ValueError(
                f"order must be a permutation of tp, pp, dp joined by '-' "
                f"(e.g. 'tp-pp-dp'), got {self.order!r}"
            )

    @property
    def axes(self) -> tuple[str, str, str]:
        """The axis names, fastest-varying first."""
        first, second, third = self.order.split("-")
        return first, second, third

    @property
    def world_size(self) -> int:
        """Number of ranks the layout spans."""
        return self.pp * self.tp * self.dp

    @property
    def model_parallel_size(self) -> int:
        """Ranks per DP replica (``p * t``): the number of training units of the model."""
        return self.pp * self.tp

    def _strides(self) -> dict[str, int]:
        """Rank stride of each axis, derived from ``order``."""
        strides: dict[str, int] = {}
        stride = 1
        for axis in self.axes:
            strides[axis] = stride
            stride *= getattr(self, axis)
        return strides

    def coords(self, rank: int) -> MeshCoord:
        """The ``(pp, tp, dp)`` coordinates of a global rank."""
        self.check_rank(rank)
        strides = self._strides()
        pos = {axis: (rank // strides[axis]) % getattr(self, axis) for axis in self.axes}
        return MeshCoord(pp=pos["pp"], tp=pos["tp"], dp=pos["dp"])

    def rank(self, *, pp: int, tp: int, dp: int) -> int:
        """The global rank at the given coordinates (inverse of :meth:`coords`)."""
        coord = {"pp": pp, "tp": tp, "dp": dp}
        for axis, value in coord.items():
            size = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"{axis} coordinate must be in [0, {size}), got {value!r}")
        strides = self._strides()
        return sum(coord[axis] * strides[axis] for axis in self.axes)

    def check_rank(self, rank: int) -> None:
        """Reject ranks outside ``[0, world_size)``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}) for {self}, got {rank!r}")


@dataclass(frozen=True)
class GenerationLayout:
    """Generation sizes ``p_g`` (pp) and ``t_g`` (tp); dp is inherited from training.

    Only layouts that evenly subdivide the training one are valid (``t_g | t``, ``p_g | p``), so
    each training DP replica splits into ``d_g = p t / (p_g t_g)`` micro-DP replicas (§5.4).
    """

    pp: int
    tp: int

    def __post_init__(self) -> None:
        """Validate sizes on their own; fit with a training layout is checked by :meth:`fit`."""
        _check_size("generation pp", self.pp)
        _check_size("generation tp", self.tp)

    def fit(self, train: ParallelLayout) -> None:
        """Raise ``ValueError`` naming both layouts unless ``t_g | t`` and ``p_g | p``."""
        problems = []
        if train.tp % self.tp:
            problems.append(f"generation tp={self.tp} does not divide training tp={train.tp}")
        if train.pp % self.pp:
            problems.append(f"generation pp={self.pp} does not divide training pp={train.pp}")
        if problems:
            raise ValueError(f"{self} does not fit {train}: " + "; ".join(problems))

    def tp_ratio(self, train: ParallelLayout) -> int:
        """``s_t = t / t_g``: training TP ranks merged into one generation TP rank."""
        self.fit(train)
        return train.tp // self.tp

    def pp_ratio(self, train: ParallelLayout) -> int:
        """``s_p = p / p_g``: training PP stages merged into one generation PP stage."""
        self.fit(train)
        return train.pp // self.pp

    def micro_dp_size(self, train: ParallelLayout) -> int:
        """``d_g = p t / (p_g t_g)``: micro-DP replicas per training DP replica."""
        return self.tp_ratio(train) * self.pp_ratio(train)

    def engine_ranks(self, world: int) -> list[tuple[int, ...]]:
        """The ranks of each rollout engine: ``p_g * t_g`` consecutive ranks (the grouping
        vLLM's ``external_launcher`` forms), engine ``i`` at ``i * p_g * t_g``."""
        size = self.pp * self.tp
        if world % size:
            raise ValueError(
                f"{self}: an engine of p_g * t_g = {size} ranks must divide the world of {world}"
            )
        return [tuple(range(first, first + size)) for first in range(0, world, size)]

    def place(self, rank: int, world: int) -> tuple[int, int, int]:
        """``(engine, engines, rank inside its engine)`` of a global rank."""
        size = self.pp * self.tp
        self.engine_ranks(world)  # checks the sizes
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank!r}")
        return rank // size, world // size, rank % size


@dataclass(frozen=True)
class Shard:
    """A contiguous block of training units: stages ``pp_stages`` x TP slices ``tp_slices``.

    Units are equal ``M / (p t)`` pieces of the model (one pipeline stage times one TP slice of
    the training layout), so memory and communication can be counted exactly (Table 2).
    """

    pp_stages: range
    tp_slices: range

    def __post_init__(self) -> None:
        """Only non-empty, step-1, non-negative ranges describe a real block of the model."""
        for name in ("pp_stages", "tp_slices"):
            r = getattr(self, name)
            if not isinstance(r, range) or r.step != 1 or len(r) == 0 or r.start < 0:
                raise ValueError(f"{name} must be a non-empty range(start, stop), got {r!r}")

    def units(self) -> frozenset[Unit]:
        """The ``(stage, slice)`` units the shard holds."""
        return frozenset((i, j) for i in self.pp_stages for j in self.tp_slices)

    def issubset(self, other: Shard) -> bool:
        """Whether every unit of this shard is also in ``other``."""
        return self.units() <= other.units()

    def fraction(self, p: int, t: int) -> Fraction:
        """The exact fraction of the model ``M`` this shard is, for a ``p x t`` training split."""
        if self.pp_stages.stop > p or self.tp_slices.stop > t:
            raise ValueError(f"{self} does not fit a model split into pp={p} x tp={t} units")
        return Fraction(len(self.pp_stages) * len(self.tp_slices), p * t)
