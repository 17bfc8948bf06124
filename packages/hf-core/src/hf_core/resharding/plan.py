"""Reshard plans for the training -> generation transition (HybridFlow §5.4, Fig. 8, Table 2).

``build_hybrid_plan`` is the 3D-HybridEngine: micro-DP groups are consecutive ranks, so each
rank's generation shard contains its training shard and a rank all-gathers only within its
``d_g`` micro-DP group.  ``build_naive_plan`` is "HybridFlow-V": every rank all-gathers the
whole model inside its DP replica, then keeps its generation slice.  Both are pure data: they
say who gathers with whom and which units move, and a backend turns that into collectives.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from hf_core.resharding.layout import GenerationLayout, MeshCoord, ParallelLayout, Shard, Unit

PlanKind = Literal["hybrid", "naive"]


@dataclass(frozen=True)
class RankPlan:
    """What one training rank does in the transition: whom it gathers with, what it ends with.

    ``recv_units`` are the units the rank's all-gather delivers from its peers (their training
    shards), so fractions derived from it count real traffic, not a formula.
    """

    rank: int
    train_coords: MeshCoord
    train_shard: Shard
    gen_shard: Shard
    gen_tp_rank: int
    gen_pp_rank: int
    micro_dp_rank: int
    gather_group: tuple[int, ...]
    gen_tp_group: tuple[int, ...]
    gen_pp_group: tuple[int, ...]
    recv_units: frozenset[Unit]
    num_units: int
    """Units in the whole model (``p * t`` of the training layout)."""

    @property
    def held_units(self) -> frozenset[Unit]:
        """Units resident after the gather: the rank's own training shard plus what it got."""
        return self.train_shard.units() | self.recv_units

    @property
    def received_fraction(self) -> float:
        """Fraction of the model ``M`` this rank receives (Table 2, "Comm. Vol")."""
        return len(self.recv_units) / self.num_units

    def received_bytes(self, model_bytes: int) -> float:
        """Bytes this rank receives for a model of ``model_bytes`` (units are equal-sized)."""
        return model_bytes * len(self.recv_units) / self.num_units

    @property
    def peak_fraction(self) -> float:
        """Fraction of ``M`` held after gathering (Table 2, "Peak Mem.")."""
        return len(self.held_units) / self.num_units

    @property
    def zero_redundancy(self) -> bool:
        """True when the training shard lives inside the generation shard and nothing beyond
        the generation shard is gathered (the 3D-HybridEngine's claim, Table 2)."""
        gen = self.gen_shard.units()
        return self.train_shard.units() <= gen and self.held_units == gen


@dataclass(frozen=True)
class ReshardPlan:
    """The per-rank plans of one transition, indexed by global rank."""

    kind: PlanKind
    train: ParallelLayout
    gen: GenerationLayout
    ranks: list[RankPlan]

    def __post_init__(self) -> None:
        """Insist on one plan per rank, in rank order, so :meth:`for_rank` can index."""
        if [rp.rank for rp in self.ranks] != list(range(self.train.world_size)):
            raise ValueError(f"ranks must hold one RankPlan per rank of {self.train}, in order")

    def for_rank(self, rank: int) -> RankPlan:
        """The plan of one global rank."""
        self.train.check_rank(rank)
        return self.ranks[rank]

    @property
    def gather_groups(self) -> list[tuple[int, ...]]:
        """Distinct all-gather groups, ordered by their lowest rank."""
        return sorted({rp.gather_group for rp in self.ranks})

    @property
    def gen_tp_groups(self) -> list[tuple[int, ...]]:
        """Distinct generation TP groups (each ordered by generation TP rank)."""
        return sorted({rp.gen_tp_group for rp in self.ranks})

    @property
    def gen_pp_groups(self) -> list[tuple[int, ...]]:
        """Distinct generation PP groups (each ordered by generation PP rank)."""
        return sorted({rp.gen_pp_group for rp in self.ranks})


@dataclass(frozen=True)
class _GenPlacement:
    """A rank's coordinates and shards on the generation mesh (Fig. 8b), before grouping."""

    rank: int
    coords: MeshCoord
    gen_tp_rank: int
    gen_pp_rank: int
    micro_dp_rank: int
    train_shard: Shard
    gen_shard: Shard


def _place(train: ParallelLayout, gen: GenerationLayout, rank: int) -> _GenPlacement:
    """Map a training rank to its generation coordinates: micro-DP groups are consecutive
    blocks of ``s_t`` TP ranks x ``s_p`` PP stages; generation TP/PP groups take strides."""
    s_t, s_p = gen.tp_ratio(train), gen.pp_ratio(train)
    c = train.coords(rank)
    g_tp, g_pp = c.tp // s_t, c.pp // s_p
    return _GenPlacement(
        rank=rank,
        coords=c,
        gen_tp_rank=g_tp,
        gen_pp_rank=g_pp,
        micro_dp_rank=(c.pp % s_p) * s_t + (c.tp % s_t),
        train_shard=Shard(range(c.pp, c.pp + 1), range(c.tp, c.tp + 1)),
        gen_shard=Shard(range(g_pp * s_p, (g_pp + 1) * s_p), range(g_tp * s_t, (g_tp + 1) * s_t)),
    )


def _groups(
    places: list[_GenPlacement],
    key: Callable[[_GenPlacement], Hashable],
    order: Callable[[_GenPlacement], int],
) -> dict[int, tuple[int, ...]]:
    """Group ranks by ``key``; each rank maps to its group's ranks sorted by ``order``."""
    members: dict[Hashable, list[_GenPlacement]] = defaultdict(list)
    for p in places:
        members[key(p)].append(p)
    return {p.rank: tuple(m.rank for m in sorted(members[key(p)], key=order)) for p in places}


def _build(train: ParallelLayout, gen: GenerationLayout, kind: PlanKind) -> ReshardPlan:
    """Shared construction: the two plans differ only in who gathers with whom."""
    gen.fit(train)
    places = [_place(train, gen, r) for r in range(train.world_size)]
    if kind == "hybrid":
        gather = _groups(places, lambda p: (p.coords.dp, p.gen_shard), lambda p: p.rank)
    else:
        gather = _groups(places, lambda p: p.coords.dp, lambda p: p.rank)
    tp_groups = _groups(
        places, lambda p: (p.coords.dp, p.micro_dp_rank, p.gen_pp_rank), lambda p: p.gen_tp_rank
    )
    pp_groups = _groups(
        places, lambda p: (p.coords.dp, p.micro_dp_rank, p.gen_tp_rank), lambda p: p.gen_pp_rank
    )
    ranks = []
    for p in places:
        peers = [places[r] for r in gather[p.rank] if r != p.rank]
        recv = frozenset().union(*(q.train_shard.units() for q in peers))
        ranks.append(
            RankPlan(
                rank=p.rank,
                train_coords=p.coords,
                train_shard=p.train_shard,
                gen_shard=p.gen_shard,
                gen_tp_rank=p.gen_tp_rank,
                gen_pp_rank=p.gen_pp_rank,
                micro_dp_rank=p.micro_dp_rank,
                gather_group=gather[p.rank],
                gen_tp_group=tp_groups[p.rank],
                gen_pp_group=pp_groups[p.rank],
                recv_units=recv - p.train_shard.units(),
                num_units=train.model_parallel_size,
            )
        )
    return ReshardPlan(kind=kind, train=train, gen=gen, ranks=ranks)


def build_hybrid_plan(train: ParallelLayout, gen: GenerationLayout) -> ReshardPlan:
    """The 3D-HybridEngine plan (Fig. 8b): all-gather within ``d_g``-sized micro-DP groups,
    zero redundancy, ``(tp - t_g p_g) / (t_g p_g tp) M`` received per rank (Table 2)."""
    return _build(train, gen, "hybrid")


def build_naive_plan(train: ParallelLayout, gen: GenerationLayout) -> ReshardPlan:
    """HybridFlow-V (Fig. 8a, Table 2): all-gather the whole model within each DP replica,
    then keep the generation slice; ``(tp - 1) / tp M`` received and ``M`` peak per rank."""
    return _build(train, gen, "naive")


def hybrid_engine_volume(train: ParallelLayout, gen: GenerationLayout) -> Fraction:
    """Table 2, HybridFlow row (exact): per-rank received ``(tp - t_g p_g) / (t_g p_g tp)`` of M."""
    gen.fit(train)
    tp, gg = train.model_parallel_size, gen.tp * gen.pp
    return Fraction(tp - gg, gg * tp)


def naive_volume(train: ParallelLayout) -> Fraction:
    """Table 2, HybridFlow-V row, exactly: per-rank received ``(tp - 1) / tp`` of M."""
    tp = train.model_parallel_size
    return Fraction(tp - 1, tp)


def hybrid_engine_volume_fraction(train: ParallelLayout, gen: GenerationLayout) -> float:
    """:func:`hybrid_engine_volume` as a float."""
    return float(hybrid_engine_volume(train, gen))


def naive_volume_fraction(train: ParallelLayout) -> float:
    """:func:`naive_volume` as a float."""
    return float(naive_volume(train))


def ds_chat_volume_fraction(train: ParallelLayout) -> float:
    """Table 2, DS-Chat row: all-gather across all ``tpd`` ranks, ``(tpd - 1) / tpd`` of M."""
    n = train.world_size
    return float(Fraction(n - 1, n))
