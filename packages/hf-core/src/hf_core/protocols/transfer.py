"""Transfer protocols: how a worker method's input is split across ranks and its output collected.

A protocol is declarative (HybridFlow §4.2, Table 3): it says

* into how many *chunks* the input is cut and which chunk each rank receives
  (``chunk_owner``; ranks with the same owner index get the same data),
* which ranks' outputs are *collected*, in which order (``collect_ranks``), and
* how the collected outputs are *combined* (a list, a concatenated batch, one value).

Because chunks and collected outputs are explicit, the runtime can hand one group's collected
chunks straight to another group's ranks (Ray object references, no round trip through the
driver) whenever the two protocols agree on the number of chunks.

Protocols are registered by every plugin, so loading the plugins (which the pre-start checks
of a recipe do) imports this module: :class:`~hf_core.batch.Batch` (tensordict, torch) is
imported only where data is split or combined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hf_core.protocols.mesh import WorkerMesh


@dataclass(frozen=True)
class GroupContext:
    """What a protocol may know about the group it dispatches to."""

    world_size: int
    meshes: tuple[WorkerMesh, ...] | None = None

    def require_meshes(self, protocol: str) -> tuple[WorkerMesh, ...]:
        if self.meshes is None:
            raise RuntimeError(f"protocol {protocol} needs the workers' meshes")
        return self.meshes


def broadcast(value: Any, chunks: int) -> list[Any]:
    """Every chunk is the whole value."""
    return [value] * chunks


def split_batches(value: Any, chunks: int) -> list[Any]:
    """Cut a :class:`Batch` into equal chunks; other values are broadcast unchanged."""
    from hf_core.batch import Batch

    if isinstance(value, Batch):
        return value.chunk(chunks)
    return broadcast(value, chunks)


def split_per_rank(value: Any, chunks: int) -> list[Any]:
    """The value is already a sequence with one entry per chunk."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or len(value) != chunks:
        got = len(value) if isinstance(value, Sequence) else type(value).__name__
        raise ValueError(f"ALL_TO_ALL expects a sequence of {chunks} per-rank values, got {got}")
    return list(value)


def concat_outputs(outputs: list[Any]) -> Any:
    """Concatenate batches; anything else is returned as the list of outputs."""
    from hf_core.batch import Batch

    if outputs and all(isinstance(o, Batch) for o in outputs):
        return Batch.concat(outputs)
    return outputs


def first_output(outputs: list[Any]) -> Any:
    return outputs[0]


def as_list(outputs: list[Any]) -> list[Any]:
    return list(outputs)


@dataclass(frozen=True)
class TransferProtocol:
    """A named dispatch/collect pair (see the module docstring)."""

    name: str
    chunk_owner: Callable[[GroupContext], list[int]]
    collect_ranks: Callable[[GroupContext], list[int]]
    split: Callable[[Any, int], list[Any]] = broadcast
    combine: Callable[[list[Any]], Any] = as_list
    needs_mesh: bool = False
    rank_zero_only: bool = False
    """Run the method on rank 0 alone (the other ranks are not called at all)."""
    chunked: bool = False
    """Outputs are data chunks that concatenate: eligible for passing chunk by chunk."""
    single_output: bool = False
    """The combined output is one collected rank's output unchanged: it may pass as-is to a
    consumer that takes a single chunk, without a round trip through the driver."""
    pad_batches: bool = False
    """A :class:`Batch` argument is padded to a multiple of the chunk count before ``split``
    (so any batch size splits evenly), and the padding rows are dropped from a batch output."""

    def num_chunks(self, ctx: GroupContext) -> int:
        return max(self.chunk_owner(ctx)) + 1

    def __repr__(self) -> str:
        return f"TransferProtocol({self.name})"


# ------------------------------------------------------------------ built-in protocols
def _all_same(ctx: GroupContext) -> list[int]:
    return [0] * ctx.world_size


def _each_rank(ctx: GroupContext) -> list[int]:
    return list(range(ctx.world_size))


def _rank_zero(ctx: GroupContext) -> list[int]:
    return [0]


def _dp_owner(ctx: GroupContext) -> list[int]:
    return [mesh.dp_rank for mesh in ctx.require_meshes("3D_PROTO")]


def _collect_per_dp(meshes: Sequence[WorkerMesh]) -> list[int]:
    """One collect rank per DP index (TP rank 0 of the last PP stage), in DP order."""
    chosen = {m.dp_rank: rank for rank, m in enumerate(meshes) if m.is_collect_rank}
    if sorted(chosen) != list(range(meshes[0].dp_size)):
        raise RuntimeError(f"meshes do not cover every DP index once: {list(meshes)}")
    return [chosen[dp] for dp in range(meshes[0].dp_size)]


def _dp_collect(ctx: GroupContext) -> list[int]:
    return _collect_per_dp(ctx.require_meshes("3D_PROTO"))


def _gen_meshes(ctx: GroupContext) -> list[WorkerMesh]:
    return [m.generation() for m in ctx.require_meshes("3D_ALL_MICRO_DP")]


def _micro_dp_owner(ctx: GroupContext) -> list[int]:
    return [m.dp_rank for m in _gen_meshes(ctx)]


def _micro_dp_collect(ctx: GroupContext) -> list[int]:
    return _collect_per_dp(_gen_meshes(ctx))


def _pp_collect(ctx: GroupContext) -> list[int]:
    meshes = ctx.require_meshes("3D_PP_ONLY")
    stages = {m.pp_rank: r for r, m in enumerate(meshes) if m.tp_rank == 0 and m.dp_rank == 0}
    return [stages[pp] for pp in range(meshes[0].pp_size)]


ONE_TO_ALL = TransferProtocol("ONE_TO_ALL", _all_same, _each_rank)
"""Broadcast the input to every rank; collect every rank's output as a list."""

ALL_TO_ALL = TransferProtocol("ALL_TO_ALL", _each_rank, _each_rank, split=split_per_rank)
"""Rank i receives entry i of each (per-rank list) argument; collect every output."""

RANK_ZERO = TransferProtocol(
    "RANK_ZERO",
    _rank_zero,
    _rank_zero,
    combine=first_output,
    rank_zero_only=True,
    single_output=True,
)
"""Call rank 0 only and return its output."""

DP_PROTO = TransferProtocol(
    "DP_PROTO",
    _each_rank,
    _each_rank,
    split_batches,
    concat_outputs,
    chunked=True,
    pad_batches=True,
)
"""Split batches evenly over all ranks (pure data parallel); concatenate the outputs."""

THREE_D_PROTO = TransferProtocol(
    "3D_PROTO",
    _dp_owner,
    _dp_collect,
    split_batches,
    concat_outputs,
    needs_mesh=True,
    chunked=True,
    pad_batches=True,
)
"""Split over DP, broadcast inside each TP/PP group; collect TP rank 0 of the last PP stage."""

THREE_D_ALL_MICRO_DP = TransferProtocol(
    "3D_ALL_MICRO_DP",
    _micro_dp_owner,
    _micro_dp_collect,
    split_batches,
    concat_outputs,
    needs_mesh=True,
    chunked=True,
    pad_batches=True,
)
"""3D_PROTO over the generation mesh: one chunk per generation replica (micro-DP included)."""

THREE_D_PP_ONLY = TransferProtocol("3D_PP_ONLY", _all_same, _pp_collect, needs_mesh=True)
"""Broadcast to every rank; collect one output per PP stage (TP rank 0, DP rank 0)."""

BUILTIN_PROTOCOLS: tuple[TransferProtocol, ...] = (
    ONE_TO_ALL,
    ALL_TO_ALL,
    RANK_ZERO,
    DP_PROTO,
    THREE_D_PROTO,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PP_ONLY,
)
