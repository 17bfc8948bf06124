"""Transfer protocols as pure functions of a group context (no Ray)."""

from __future__ import annotations

import pytest

from hf_core.protocols import (
    ALL_TO_ALL,
    DP_PROTO,
    ONE_TO_ALL,
    RANK_ZERO,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PP_ONLY,
    THREE_D_PROTO,
    GroupContext,
    WorkerMesh,
    register,
    registered_methods,
)
from hf_core.worker import Worker


def meshes(tp: int, pp: int, dp: int) -> tuple[WorkerMesh, ...]:
    """Ranks numbered tp fastest, then pp, then dp."""
    return tuple(
        WorkerMesh(
            dp_rank=r // (tp * pp),
            dp_size=dp,
            tp_rank=r % tp,
            tp_size=tp,
            pp_rank=(r // tp) % pp,
            pp_size=pp,
        )
        for r in range(tp * pp * dp)
    )


def test_simple_protocols() -> None:
    ctx = GroupContext(world_size=4)
    assert ONE_TO_ALL.chunk_owner(ctx) == [0, 0, 0, 0]
    assert ALL_TO_ALL.chunk_owner(ctx) == [0, 1, 2, 3]
    assert DP_PROTO.num_chunks(ctx) == 4
    assert RANK_ZERO.collect_ranks(ctx) == [0] and RANK_ZERO.rank_zero_only


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "owner", "collect"),
    [
        (2, 1, 2, [0, 0, 1, 1], [0, 2]),
        (1, 2, 2, [0, 0, 1, 1], [1, 3]),
        (2, 2, 1, [0, 0, 0, 0], [2]),
        (2, 2, 2, [0, 0, 0, 0, 1, 1, 1, 1], [2, 6]),
    ],
)
def test_3d_proto(tp: int, pp: int, dp: int, owner: list[int], collect: list[int]) -> None:
    ctx = GroupContext(tp * pp * dp, meshes(tp, pp, dp))
    assert THREE_D_PROTO.chunk_owner(ctx) == owner
    assert THREE_D_PROTO.collect_ranks(ctx) == collect


def test_3d_pp_only_collects_one_rank_per_stage() -> None:
    ctx = GroupContext(8, meshes(2, 2, 2))
    assert THREE_D_PP_ONLY.chunk_owner(ctx) == [0] * 8
    assert THREE_D_PP_ONLY.collect_ranks(ctx) == [0, 2]


def test_micro_dp_defaults_to_the_training_mesh() -> None:
    ctx = GroupContext(4, meshes(2, 1, 2))
    assert THREE_D_ALL_MICRO_DP.chunk_owner(ctx) == THREE_D_PROTO.chunk_owner(ctx)
    assert THREE_D_ALL_MICRO_DP.collect_ranks(ctx) == [0, 2]


def test_sequence_parallel_ranks_share_a_chunk_and_generate_apart() -> None:
    """Ranks of one sequence-parallel group get the same chunk and the first one's output is
    collected; generation (its own mesh) sends every rank a chunk of its own."""
    sp, dp = 2, 2
    world = sp * dp
    ranks = tuple(
        WorkerMesh(r // sp, dp, sp_rank=r % sp, sp_size=sp, gen_dp_rank=r, gen_dp_size=world)
        for r in range(world)
    )
    ctx = GroupContext(world, ranks)
    assert THREE_D_PROTO.chunk_owner(ctx) == [0, 0, 1, 1]
    assert THREE_D_PROTO.collect_ranks(ctx) == [0, 2]
    assert THREE_D_ALL_MICRO_DP.chunk_owner(ctx) == [0, 1, 2, 3]
    assert THREE_D_ALL_MICRO_DP.collect_ranks(ctx) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="sp_rank=2 is outside sp_size=2"):
        WorkerMesh(0, 1, sp_rank=2, sp_size=2)


def test_3d_protocols_need_meshes() -> None:
    with pytest.raises(RuntimeError, match="needs the workers' meshes"):
        THREE_D_PROTO.chunk_owner(GroupContext(4))


def test_mesh_validation() -> None:
    with pytest.raises(ValueError, match="tp_rank=2 is outside tp_size=2"):
        WorkerMesh(dp_rank=0, dp_size=1, tp_rank=2, tp_size=2)


def test_register_marks_methods_and_inherits() -> None:
    class Base(Worker):
        @register("DP_PROTO", blocking=False)
        def a(self) -> None: ...

    class Child(Base):
        @register(RANK_ZERO)
        def b(self) -> None: ...

        def plain(self) -> None: ...

    specs = registered_methods(Child)
    assert set(specs) == {"a", "b"}
    assert specs["a"].protocol_name == "DP_PROTO" and not specs["a"].blocking
    assert specs["b"].protocol is RANK_ZERO
    with pytest.raises(ValueError, match="execute must be"):
        register(execute="sometimes")  # type: ignore[arg-type]


def test_worker_set_mesh_checks_world_size() -> None:
    worker = Worker()
    with pytest.raises(ValueError, match="does not match world size 1"):
        worker.set_mesh(WorkerMesh(dp_rank=0, dp_size=1, tp_rank=0, tp_size=2))
