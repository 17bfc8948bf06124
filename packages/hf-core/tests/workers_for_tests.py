"""Worker classes driven by the runtime tests (importable by Ray worker processes)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from hf_core.batch import Batch
from hf_core.errors import EngineDiedError
from hf_core.protocols import WorkerMesh, register
from hf_core.resharding import GenerationLayout, ParallelLayout, build_hybrid_plan
from hf_core.worker import Worker


class ProbeWorker(Worker):
    """Records every input it receives and tags outputs with its rank."""

    def __init__(self, tag: str = "probe") -> None:
        super().__init__()
        self.tag = tag
        self.received: list[tuple[str, object]] = []

    def _tagged(self, method: str, batch: Batch) -> Batch:
        self.received.append((method, batch["x"].tolist()))
        out = Batch({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)})
        return out

    @register("ONE_TO_ALL")
    def one_to_all(self, value: object) -> tuple[int, object]:
        self.received.append(("one_to_all", value))
        return self.rank, value

    @register("ALL_TO_ALL")
    def environment(self, name: str) -> str | None:  # ALL_TO_ALL: one name per rank
        """This process's value of an environment variable."""
        return os.environ.get(name)

    @register("ALL_TO_ALL")
    def all_to_all(self, value: object) -> tuple[int, object]:
        self.received.append(("all_to_all", value))
        return self.rank, value

    @register("RANK_ZERO")
    def rank_zero(self, value: object) -> tuple[int, object]:
        self.received.append(("rank_zero", value))
        return self.rank, value

    @register("DP_PROTO")
    def dp(self, batch: Batch) -> Batch:
        return self._tagged("dp", batch)

    @register("DP_PROTO", blocking=False)
    def dp_async(self, batch: Batch) -> Batch:
        return self._tagged("dp_async", batch)

    @register("3D_PROTO")
    def three_d(self, batch: Batch) -> Batch:
        return self._tagged("3d", batch)

    @register("3D_ALL_MICRO_DP")
    def micro_dp(self, batch: Batch) -> Batch:
        return self._tagged("micro_dp", batch)

    @register("3D_PP_ONLY")
    def pp_only(self, value: object) -> tuple[int, int, object]:
        self.received.append(("pp_only", value))
        return self.rank, self.mesh.pp_rank, value

    @register("ONE_TO_ALL")
    def take_received(self) -> list[tuple[str, object]]:
        received, self.received = self.received, []
        return received

    @register("ONE_TO_ALL")
    def configure_mesh(self, tp: int, pp: int, gen_tp: int = 1, gen_pp: int = 1) -> WorkerMesh:
        """Adopt a (pp, tp, dp) mesh, tp fastest, and the 3D-HybridEngine generation mesh."""
        dp = self.world_size // (tp * pp)
        layout = ParallelLayout(pp=pp, tp=tp, dp=dp)
        gen = GenerationLayout(pp=gen_pp, tp=gen_tp)
        plan = build_hybrid_plan(layout, gen).for_rank(self.rank)
        micro = gen.micro_dp_size(layout)
        coords = layout.coords(self.rank)
        mesh = WorkerMesh(
            dp_rank=coords.dp,
            dp_size=dp,
            tp_rank=coords.tp,
            tp_size=tp,
            pp_rank=coords.pp,
            pp_size=pp,
            gen_dp_rank=coords.dp * micro + plan.micro_dp_rank,
            gen_dp_size=dp * micro,
            gen_tp_rank=plan.gen_tp_rank,
            gen_tp_size=gen_tp,
            gen_pp_rank=plan.gen_pp_rank,
            gen_pp_size=gen_pp,
        )
        self.set_mesh(mesh)
        return mesh

    @register("ONE_TO_ALL")
    def all_reduce_ranks(self) -> int:
        value = torch.tensor([self.rank])
        dist.all_reduce(value)
        return int(value.item())

    @register("ONE_TO_ALL")
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom on purpose at rank {rank}")
        return self.rank

    @register("ONE_TO_ALL")
    def engine_dies_on(self, rank: int) -> int:
        """``rank``'s engine fails for good (its process lives on); the others answer."""
        if self.rank == rank:
            raise EngineDiedError(f"the engine of rank {rank} failed on purpose")
        return self.rank

    @register("ONE_TO_ALL")
    def fail_before_collective(self, rank: int) -> int:
        """``rank`` raises; the others enter an all-reduce it never joins."""
        if self.rank == rank:
            raise RuntimeError(f"rank {rank} fails before the all-reduce")
        value = torch.ones(1)
        dist.all_reduce(value)
        return int(value.item())

    @register("ONE_TO_ALL")
    def die_on(self, rank: int, how: str) -> int:
        """``rank`` dies (or freezes); the others wait as if blocked in a collective."""
        if self.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(120)
        return self.rank

    @register("ONE_TO_ALL", blocking=False)
    def sleep_interval(self, seconds: float) -> tuple[float, float]:
        start = time.time()
        time.sleep(seconds)
        return start, time.time()


class HolderWorker(Worker):
    """Owns a tensor; a colocated ReaderWorker reads it through shared process memory."""

    def __init__(self) -> None:
        super().__init__()
        self.tensor = torch.zeros(4)

    @register("ONE_TO_ALL")
    def fill(self, value: float) -> tuple[int, int]:
        self.tensor.fill_(value)
        return os.getpid(), self.tensor.data_ptr()


class ReaderWorker(Worker):
    @register("ONE_TO_ALL")
    def read_holder(self) -> tuple[int, int, list[float]]:
        holder = self.colocated("holder")
        return os.getpid(), holder.tensor.data_ptr(), holder.tensor.tolist()

    @register("ONE_TO_ALL")
    def pid(self) -> int:
        return os.getpid()


class ReversedWorker(Worker):
    """Uses a protocol that only a plugin provides (looked up by name at call time)."""

    @register("REVERSED_DP")
    def who_got(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)})
