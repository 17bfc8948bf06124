"""Checks of the 3D-HybridEngine reshard plan against HybridFlow §5.4, Fig. 8 and Table 2.

Volumes are checked by counting the units each rank actually receives from its gather group
and comparing with the Table 2 formulas as exact fractions.
"""

from __future__ import annotations

import itertools
from collections import Counter
from fractions import Fraction

import pytest

from hf_core.resharding import (
    GenerationLayout,
    MeshCoord,
    ParallelLayout,
    RankPlan,
    ReshardPlan,
    Shard,
    build_hybrid_plan,
    build_naive_plan,
    ds_chat_volume_fraction,
    hybrid_engine_volume_fraction,
    naive_volume_fraction,
)

SIZES = (1, 2, 4, 8)
ORDERS = ("tp-pp-dp", "tp-dp-pp")


def _divisors(n: int) -> list[int]:
    """Divisors of ``n``: the valid generation sizes for a training size ``n``."""
    return [k for k in range(1, n + 1) if n % k == 0]


GRID = [
    (ParallelLayout(pp=p, tp=t, dp=d, order=order), GenerationLayout(pp=pg, tp=tg))
    for p, t, d, order in itertools.product(SIZES, SIZES, (1, 2), ORDERS)
    for pg in _divisors(p)
    for tg in _divisors(t)
]


def _ids(case: tuple[ParallelLayout, GenerationLayout]) -> str:
    """Readable test id for a (train, gen) pair."""
    train, gen = case
    return f"p{train.pp}t{train.tp}d{train.dp}-{train.order}-pg{gen.pp}tg{gen.tp}"


def _counted_fraction(rp: RankPlan, train: ParallelLayout) -> Fraction:
    """Fraction of M received, by counting units rather than by formula."""
    return Fraction(len(rp.recv_units), train.pp * train.tp)


def _all_units(train: ParallelLayout) -> set[tuple[int, int]]:
    """Every unit of the model for a training layout."""
    return {(i, j) for i in range(train.pp) for j in range(train.tp)}


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize("order", ["tp-pp-dp", "tp-dp-pp", "pp-tp-dp", "dp-pp-tp"])
def test_coords_and_rank_round_trip(order: str) -> None:
    layout = ParallelLayout(pp=2, tp=4, dp=3, order=order)
    seen = set()
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert layout.rank(pp=c.pp, tp=c.tp, dp=c.dp) == r
        seen.add(c)
    assert len(seen) == layout.world_size == 24


def test_default_order_makes_dp_replicas_contiguous() -> None:
    layout = ParallelLayout(pp=2, tp=4, dp=2)
    assert layout.coords(0) == MeshCoord(pp=0, tp=0, dp=0)
    assert layout.coords(5) == MeshCoord(pp=1, tp=1, dp=0)
    assert layout.coords(8) == MeshCoord(pp=0, tp=0, dp=1)
    megatron = ParallelLayout(pp=2, tp=4, dp=2, order="tp-dp-pp")
    assert megatron.coords(4) == MeshCoord(pp=0, tp=0, dp=1)
    assert megatron.coords(8) == MeshCoord(pp=1, tp=0, dp=0)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"pp": 0, "tp": 2, "dp": 1}, "pp must be an integer >= 1, got 0"),
        ({"pp": 1, "tp": -2, "dp": 1}, "tp must be an integer >= 1, got -2"),
        ({"pp": 1, "tp": 2, "dp": 1.5}, "dp must be an integer >= 1, got 1.5"),
        ({"pp": 1, "tp": 2, "dp": 1, "order": "tp-pp"}, "'tp-pp'"),
        ({"pp": 1, "tp": 2, "dp": 1, "order": "tp-tp-dp"}, "'tp-tp-dp'"),
    ],
)
def test_bad_parallel_layout(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        ParallelLayout(**kwargs)


def test_bad_rank_and_coords() -> None:
    layout = ParallelLayout(pp=2, tp=2, dp=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 8\).*got 8"):
        layout.coords(8)
    with pytest.raises(ValueError, match=r"tp coordinate must be in \[0, 2\), got 2"):
        layout.rank(pp=0, tp=2, dp=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 8\).*got -1"):
        build_hybrid_plan(layout, GenerationLayout(pp=1, tp=1)).for_rank(-1)


def test_bad_generation_layout_names_both_layouts() -> None:
    train = ParallelLayout(pp=2, tp=4, dp=1)
    with pytest.raises(ValueError, match="generation tp must be an integer >= 1, got 0"):
        GenerationLayout(pp=1, tp=0)
    with pytest.raises(ValueError) as err:
        build_hybrid_plan(train, GenerationLayout(pp=1, tp=3))
    msg = str(err.value)
    assert "GenerationLayout(pp=1, tp=3)" in msg and "ParallelLayout(pp=2, tp=4, dp=1" in msg
    assert "generation tp=3 does not divide training tp=4" in msg
    with pytest.raises(ValueError, match="generation pp=4 does not divide training pp=2"):
        build_naive_plan(train, GenerationLayout(pp=4, tp=2))
    with pytest.raises(ValueError, match="GenerationLayout"):
        hybrid_engine_volume_fraction(train, GenerationLayout(pp=3, tp=1))


def test_shard_basics() -> None:
    small, big = Shard(range(1, 2), range(2, 3)), Shard(range(2), range(2, 4))
    assert small.units() == {(1, 2)}
    assert small.issubset(big) and not big.issubset(small)
    assert big.fraction(2, 4) == Fraction(1, 2)
    with pytest.raises(ValueError, match="pp_stages"):
        Shard(range(0), range(1))
    with pytest.raises(ValueError, match="pp=1 x tp=4"):
        big.fraction(1, 4)


# ---------------------------------------------------------------- the paper's plan, on a grid


@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_hybrid_plan_grid(case: tuple[ParallelLayout, GenerationLayout]) -> None:
    train, gen = case
    plan = build_hybrid_plan(train, gen)
    p, t = train.pp, train.tp
    d_g = (p * t) // (gen.pp * gen.tp)
    table2 = Fraction(t * p - gen.tp * gen.pp, gen.tp * gen.pp * t * p)
    assert plan.kind == "hybrid" and len(plan.ranks) == train.world_size
    assert hybrid_engine_volume_fraction(train, gen) == pytest.approx(float(table2))

    for rp in plan.ranks:
        assert plan.for_rank(rp.rank) is rp
        assert rp.train_coords == train.coords(rp.rank)
        assert rp.train_shard.issubset(rp.gen_shard)
        assert rp.zero_redundancy
        # Counted traffic equals Table 2, and is exactly the gen shard minus what the rank had.
        assert _counted_fraction(rp, train) == table2
        assert rp.received_fraction == pytest.approx(float(table2))
        assert rp.recv_units == rp.gen_shard.units() - rp.train_shard.units()
        assert rp.peak_fraction == pytest.approx(1 / (gen.tp * gen.pp))
        assert rp.gen_shard.fraction(p, t) == Fraction(1, gen.tp * gen.pp)
        # Every needed unit is a training shard of some member of the gather group.
        held_by_group = set().union(
            *(plan.for_rank(r).train_shard.units() for r in rp.gather_group)
        )
        assert rp.gen_shard.units() <= held_by_group
        assert rp.rank in rp.gather_group and list(rp.gather_group) == sorted(rp.gather_group)
        # Generation TP/PP groups are ordered by generation rank and share micro-DP rank.
        tp_members = [plan.for_rank(r) for r in rp.gen_tp_group]
        assert [m.gen_tp_rank for m in tp_members] == list(range(gen.tp))
        assert {(m.micro_dp_rank, m.gen_pp_rank, m.train_coords.dp) for m in tp_members} == {
            (rp.micro_dp_rank, rp.gen_pp_rank, rp.train_coords.dp)
        }
        pp_members = [plan.for_rank(r) for r in rp.gen_pp_group]
        assert [m.gen_pp_rank for m in pp_members] == list(range(gen.pp))
        assert 0 <= rp.micro_dp_rank < d_g

    # Gather groups partition each DP replica into groups of size d_g.
    for dp in range(train.dp):
        replica = {train.rank(pp=i, tp=j, dp=dp) for i in range(p) for j in range(t)}
        groups = [g for g in plan.gather_groups if set(g) <= replica]
        assert all(len(g) == d_g for g in groups)
        assert sorted(r for g in groups for r in g) == sorted(replica)
    assert sum(len(g) for g in plan.gather_groups) == train.world_size

    # A generation TP x PP group (same dp, same micro-DP rank) covers the model exactly once.
    model_groups: dict[tuple[int, int], list[RankPlan]] = {}
    for rp in plan.ranks:
        model_groups.setdefault((rp.train_coords.dp, rp.micro_dp_rank), []).append(rp)
    assert len(model_groups) == train.dp * d_g
    for members in model_groups.values():
        assert len(members) == gen.tp * gen.pp
        counts = Counter(u for m in members for u in m.gen_shard.units())
        assert set(counts) == _all_units(train) and set(counts.values()) == {1}


# ---------------------------------------------------------------- the naive plan


@pytest.mark.parametrize("case", GRID[::3], ids=_ids)
def test_naive_plan_grid(case: tuple[ParallelLayout, GenerationLayout]) -> None:
    train, gen = case
    plan = build_naive_plan(train, gen)
    hybrid = build_hybrid_plan(train, gen)
    pt = train.pp * train.tp
    assert plan.kind == "naive"
    assert naive_volume_fraction(train) == pytest.approx((pt - 1) / pt)
    for rp, hp in zip(plan.ranks, hybrid.ranks, strict=True):
        assert _counted_fraction(rp, train) == Fraction(pt - 1, pt)
        assert rp.held_units == _all_units(train) and rp.peak_fraction == 1.0
        assert len(rp.gather_group) == pt
        assert rp.gen_shard == hp.gen_shard and rp.gen_tp_group == hp.gen_tp_group
        # Gathering all of M is redundant unless generation needs all of M (t_g p_g = 1).
        assert rp.zero_redundancy is (gen.tp * gen.pp == 1)


def test_naive_redundant_when_generation_is_smaller() -> None:
    plan = build_naive_plan(ParallelLayout(pp=2, tp=4, dp=2), GenerationLayout(pp=1, tp=2))
    assert not any(rp.zero_redundancy for rp in plan.ranks)
    assert plan.gather_groups == [tuple(range(8)), tuple(range(8, 16))]


# ---------------------------------------------------------------- hand-checked examples


def test_hand_checked_p1_t4_tg2() -> None:
    """p=1, t=4, t_g=2, d=1: Fig. 8b in one row."""
    plan = build_hybrid_plan(ParallelLayout(pp=1, tp=4, dp=1), GenerationLayout(pp=1, tp=2))
    assert plan.gather_groups == [(0, 1), (2, 3)]
    assert plan.gen_tp_groups == [(0, 2), (1, 3)]
    assert plan.gen_pp_groups == [(0,), (1,), (2,), (3,)]
    r0, r1, r2, r3 = plan.ranks
    assert (r0.gen_tp_rank, r0.micro_dp_rank) == (0, 0)
    assert (r1.gen_tp_rank, r1.micro_dp_rank) == (0, 1)
    assert (r2.gen_tp_rank, r2.micro_dp_rank) == (1, 0)
    assert (r3.gen_tp_rank, r3.micro_dp_rank) == (1, 1)
    assert r0.gen_shard == r1.gen_shard == Shard(range(1), range(2))
    assert r2.gen_shard == Shard(range(1), range(2, 4))
    assert r0.recv_units == {(0, 1)} and r3.recv_units == {(0, 2)}
    assert r0.received_fraction == 0.25 and r0.peak_fraction == 0.5
    assert r0.received_bytes(1000) == 250


def test_hand_checked_p2_t4_d2_pg1_tg2() -> None:
    """The API example: rank 5 is (pp=1, tp=1, dp=0); s_t=2, s_p=2, d_g=4."""
    plan = build_hybrid_plan(ParallelLayout(pp=2, tp=4, dp=2), GenerationLayout(pp=1, tp=2))
    rp = plan.for_rank(5)
    assert rp.train_coords == MeshCoord(pp=1, tp=1, dp=0)
    assert (rp.gen_tp_rank, rp.gen_pp_rank, rp.micro_dp_rank) == (0, 0, 3)
    assert rp.train_shard == Shard(range(1, 2), range(1, 2))
    assert rp.gen_shard == Shard(range(2), range(2))
    assert rp.gather_group == (0, 1, 4, 5)
    assert rp.gen_tp_group == (5, 7)
    assert rp.gen_pp_group == (5,)
    assert rp.recv_units == {(0, 0), (0, 1), (1, 0)}
    assert rp.received_fraction == 3 / 8 == hybrid_engine_volume_fraction(plan.train, plan.gen)
    assert plan.for_rank(13).gather_group == (8, 9, 12, 13)


def test_ds_chat_volume() -> None:
    assert ds_chat_volume_fraction(ParallelLayout(pp=2, tp=4, dp=2)) == 15 / 16


def test_plan_rejects_misordered_ranks() -> None:
    plan = build_hybrid_plan(ParallelLayout(pp=1, tp=2, dp=1), GenerationLayout(pp=1, tp=1))
    with pytest.raises(ValueError, match="one RankPlan per rank"):
        ReshardPlan(kind="hybrid", train=plan.train, gen=plan.gen, ranks=plan.ranks[::-1])
