"""The hybrid engine's pieces in the loop, with toy engines: the one weight-sync path, Table 2's
expected volume, the per-rank metric merge, the memory hand-over and the recipe checks."""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from hf_core import plugins
from hf_core.config import ConfigError, TrainerConfig
from hf_core.config.layout import resolve_layout
from hf_core.engines import (
    CanonicalSlice,
    GenerationRank,
    HasGenerationRank,
    LoadsTPSlices,
    Offloadable,
    ReshardsWeights,
)
from hf_core.resharding import (
    GenerationLayout,
    ParallelLayout,
    ReshardReport,
    build_hybrid_plan,
    build_naive_plan,
    expected_received_bytes,
)
from hf_core.roles.handover import MemoryHandover, handover_metrics
from hf_core.sync import HybridSync, build_plan, merge_rank_metrics
from hf_core.trainer.preflight import preflight
from hf_testing.toy_engines import register_toy_engine

# --------------------------------------------------------------------------- toy engines


class ToyActor:
    """A model-parallel training engine: one weight, split on dim 0 over ``t`` TP ranks."""

    def __init__(self, layout: ParallelLayout, rank: int) -> None:
        self.layout, self.rank = layout, rank
        self.full = torch.arange(8.0).reshape(4, 2)
        self.report: ReshardReport | None = None
        self.plans: list[Any] = []

    def parallel_layout(self) -> ParallelLayout:
        return self.layout

    def export_slices(self, bucket_bytes: int, plan: Any) -> Iterator[list[CanonicalSlice]]:
        self.plans.append(plan)
        rp = plan.for_rank(self.rank)
        t_g, tp = plan.gen.tp, rp.gen_tp_rank
        rows = 4 // t_g
        part = self.full[tp * rows : (tp + 1) * rows]
        dim = None if t_g == 1 else 0
        yield [CanonicalSlice("w", part, dim, tp * rows, (4, 2))]
        received = rp.received_bytes(64)
        self.report = ReshardReport(plan.kind, int(received), 64, 16, rp.zero_redundancy, 0.01)

    def last_reshard(self) -> ReshardReport | None:
        return self.report

    def export_weights(self, bucket_bytes: int, plan: Any = None) -> Iterator[list[Any]]:
        yield [("w", self.full)]


class DataParallelActor(ToyActor):
    """Whole tensors only (like FSDP): no ``parallel_layout``/``export_slices``."""

    parallel_layout = None  # type: ignore[assignment]
    export_slices = None  # type: ignore[assignment]
    last_reshard = None  # type: ignore[assignment]


def record(log: list[str], action: str, nbytes: int) -> int:
    """A toy engine's memory move: remembered in order, ``nbytes`` reported."""
    log.append(action)
    return nbytes


class ToyRollout:
    def __init__(self) -> None:
        self.loaded: list[Any] = []
        self.finished = 0
        self.memory: list[str] = []

    def load_weights(self, bucket: Any) -> None:
        self.loaded.extend(bucket)

    def finish_weight_sync(self) -> None:
        self.finished += 1

    def sync_metrics(self) -> dict[str, float]:
        return {"weight_sync/buckets": 1.0}

    def release_memory(self) -> int:
        return record(self.memory, "release", 100)

    def resume_memory(self) -> int:
        return record(self.memory, "resume", 100)


class SlicingRollout(ToyRollout):
    """Loads TP slices over ``t_g`` consecutive ranks."""

    def __init__(self, t_g: int, rank: int, world: int, tp_rank: int | None = None) -> None:
        super().__init__()
        self.t_g, self.rank, self.world = t_g, rank, world
        self.tp_rank = rank % t_g if tp_rank is None else tp_rank

    def generation_layout(self) -> GenerationLayout:
        return GenerationLayout(pp=1, tp=self.t_g)

    def generation_rank(self) -> GenerationRank:
        return GenerationRank(self.rank // self.t_g, self.world // self.t_g, self.tp_rank, self.t_g)


def test_toys_have_the_capabilities_they_claim() -> None:
    layout = ParallelLayout(pp=1, tp=2, dp=1, order="tp-dp-pp")
    assert isinstance(ToyActor(layout, 0), ReshardsWeights)
    assert not isinstance(DataParallelActor(layout, 0), ReshardsWeights)
    rollout = SlicingRollout(2, 0, 2)
    assert isinstance(rollout, LoadsTPSlices) and isinstance(rollout, HasGenerationRank)
    assert not isinstance(ToyRollout(), LoadsTPSlices)


# ------------------------------------------------------------------------ weight sync


def test_plan_comes_from_the_two_engines_layouts() -> None:
    layout = ParallelLayout(pp=2, tp=2, dp=1, order="tp-dp-pp")
    actor = ToyActor(layout, rank=1)
    plan = build_plan(actor, SlicingRollout(2, 1, 4), "hybrid")
    assert plan == build_hybrid_plan(layout, GenerationLayout(pp=1, tp=2))
    whole = build_plan(actor, ToyRollout(), "naive")  # a whole-tensor engine: t_g = 1
    assert whole == build_naive_plan(layout, GenerationLayout(pp=1, tp=1))
    assert build_plan(DataParallelActor(layout, 0), SlicingRollout(2, 0, 4), "hybrid") is None
    resolved = GenerationLayout(pp=1, tp=2)  # the run's layout agrees with the engine's
    assert build_plan(actor, SlicingRollout(2, 1, 4), "hybrid", resolved) == plan
    with pytest.raises(RuntimeError, match="but the run's resolved layout is"):
        build_plan(actor, ToyRollout(), "hybrid", resolved)  # it built whole-model engines


def test_generation_tp_that_does_not_divide_training_tp_is_refused() -> None:
    layout = ParallelLayout(pp=1, tp=2, dp=1, order="tp-dp-pp")
    with pytest.raises(ValueError, match="t_g must divide t"):
        build_plan(ToyActor(layout, 0), SlicingRollout(4, 0, 4), "hybrid")


def test_slices_reach_a_slicing_engine_and_metrics_follow_table_2() -> None:
    layout = ParallelLayout(pp=1, tp=2, dp=1, order="tp-dp-pp")
    actor, rollout = ToyActor(layout, rank=1), SlicingRollout(2, 1, 2)
    metrics = HybridSync(actor, rollout, bucket_bytes=1024, rank=1).run()
    (piece,) = rollout.loaded
    assert isinstance(piece, CanonicalSlice) and (piece.dim, piece.start) == (0, 2)
    assert torch.equal(piece.tensor, actor.full[2:4])
    assert rollout.finished == 1
    assert metrics["reshard/bytes_received"] == metrics["reshard/bytes_expected"] == 0.0
    assert metrics["reshard/zero_redundancy"] == 1.0
    assert metrics["weight_sync/buckets"] == 1.0 and metrics["perf/weight_sync_s"] > 0


def test_whole_tensor_engine_gets_name_tensor_pairs() -> None:
    layout = ParallelLayout(pp=1, tp=2, dp=1, order="tp-dp-pp")
    rollout = ToyRollout()
    metrics = HybridSync(ToyActor(layout, 0), rollout, bucket_bytes=1024, kind="naive").run()
    (item,) = rollout.loaded
    assert item[0] == "w" and torch.equal(item[1], torch.arange(8.0).reshape(4, 2))
    assert metrics["reshard/bytes_received"] == metrics["reshard/bytes_expected"] == 32.0


def test_data_parallel_actor_streams_whole_tensors_without_reshard_metrics() -> None:
    layout = ParallelLayout(pp=1, tp=1, dp=2)
    rollout = SlicingRollout(2, 0, 2)  # a TP engine shards whole tensors itself
    metrics = HybridSync(DataParallelActor(layout, 0), rollout, bucket_bytes=1024).run()
    assert rollout.loaded[0][0] == "w"
    assert not any(k.startswith("reshard/") for k in metrics)


def test_rollout_tp_group_must_be_the_plans() -> None:
    layout = ParallelLayout(pp=1, tp=2, dp=1, order="tp-dp-pp")
    with pytest.raises(RuntimeError, match="not the plan's generation TP group"):
        HybridSync(ToyActor(layout, 0), SlicingRollout(2, 0, 2, tp_rank=1), bucket_bytes=8)


@pytest.mark.parametrize(("pp", "tp", "t_g"), [(1, 2, 1), (1, 2, 2), (2, 2, 2), (2, 4, 2)])
def test_expected_bytes_are_table_2(pp: int, tp: int, t_g: int) -> None:
    layout = ParallelLayout(pp=pp, tp=tp, dp=1)
    gen = GenerationLayout(pp=1, tp=t_g)
    model = 64 * pp * tp
    hybrid = build_hybrid_plan(layout, gen)
    pt = pp * tp
    assert expected_received_bytes(hybrid, model) == Fraction(pt - t_g, t_g * pt) * model
    assert expected_received_bytes(hybrid, model) == hybrid.for_rank(0).received_bytes(model)
    naive = build_naive_plan(layout, gen)
    assert expected_received_bytes(naive, model) == Fraction(pt - 1, pt) * model
    with pytest.raises(ValueError, match="equal training units"):
        expected_received_bytes(naive, model + 1)  # (pt - 1) / pt of an uneven size


def test_rank_metrics_merge_to_the_worst_rank() -> None:
    rows = [
        {"reshard/zero_redundancy": 1.0, "reshard/bytes_received": 10.0, "perf/weight_sync_s": 2.0},
        {"reshard/zero_redundancy": 0.0, "reshard/bytes_received": 30.0, "perf/weight_sync_s": 1.0},
    ]
    assert merge_rank_metrics(rows) == {
        "reshard/zero_redundancy": 0.0,
        "reshard/bytes_received": 30.0,
        "perf/weight_sync_s": 2.0,
    }


# ---------------------------------------------------------------------------- hand-over


class OffloadingActor(ToyActor):
    def __init__(self) -> None:
        super().__init__(ParallelLayout(pp=1, tp=1, dp=1), 0)
        self.moves: list[str] = []

    def offload(self) -> int:
        return record(self.moves, "offload", 300)

    def onload(self) -> int:
        return record(self.moves, "onload", 300)


def test_handover_moves_once_per_phase_change_in_order() -> None:
    actor, reference, rollout = OffloadingActor(), OffloadingActor(), ToyRollout()
    assert isinstance(actor, Offloadable)
    handover = MemoryHandover(actor, reference, rollout)  # type: ignore[arg-type]
    handover.to_training()  # already training: nothing moves
    with handover.stage("generate"):
        handover.to_generation()
        handover.to_generation()
    handover.to_training()
    handover.resume_rollout()  # the weight sync needs the rollout engine's weights back
    handover.to_generation()
    log = handover.take_log()
    moves = [(e["engine"], e["action"]) for e in log["events"]]  # type: ignore[union-attr]
    assert moves == [
        ("actor", "offload"),
        ("reference", "offload"),
        ("rollout", "release"),
        ("actor", "onload"),
        ("reference", "onload"),
        ("rollout", "resume"),
        ("actor", "offload"),
        ("reference", "offload"),
    ]
    assert log["stage_peaks_gib"]["generate"] > 0  # type: ignore[index]
    assert handover.take_log()["events"] == []  # the log starts afresh
    metrics = handover_metrics([log, {"events": [], "stage_peaks_gib": {"generate": 99.0}}])
    assert metrics["handover/actor_offload_bytes"] == 600.0
    assert metrics["handover/rollout_release_bytes"] == 100.0
    assert metrics["memory/generate_peak_gib"] == 99.0


# ------------------------------------------------------------------------ recipe checks


class TPSettings(BaseModel):
    """A model-parallel engine's settings: what the trainer passes, and the two sizes."""

    model_config = ConfigDict(extra="forbid")
    model_path: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_parallel_size: int = 1
    head: str = "lm"
    trainable: bool = True
    seed: int = 0


class RolloutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    tensor_parallel_size: int = 1


@pytest.fixture
def engines() -> Iterator[None]:
    """Toy engines with the axes real ones declare (megatron-like, FSDP-like, TP / whole)."""
    plugins.reset()
    for name, axes in (("mp-toy", ("tp", "pp")), ("dp-toy", ()), ("sp-toy", ("sp",))):
        register_toy_engine("training", name, settings=TPSettings, axes=axes)
    register_toy_engine("rollout", "tp-toy", settings=RolloutSettings, axes=("tp",))
    register_toy_engine("rollout", "whole-toy")
    yield
    plugins.reset()


WHOLE = {"backend": "whole-toy"}
"""A rollout backend the toy registry has (the default one is a backend's, not installed here)."""


def _config(
    tmp_path: Path,
    actor: str,
    rollout: dict[str, Any],
    engine: dict[str, Any] | None = None,
    **parallel: int,
) -> Any:
    return TrainerConfig.model_validate(
        {
            "model": {"path": str(tmp_path)},
            "reward": {"function": "digits_reverse"},
            "placement": {"processes": 4},
            "rollout": {"n": 2, **rollout},
            "actor": {"backend": actor, "parallel": parallel, "engine": engine or {}},
        }
    )


@pytest.mark.usefixtures("engines")
def test_generation_layouts_are_checked_when_the_recipe_loads(tmp_path: Path) -> None:
    ok = _config(tmp_path, "mp-toy", {"backend": "tp-toy", "tensor_parallel_size": 2}, tp=2, pp=2)
    preflight(ok)
    preflight(_config(tmp_path, "dp-toy", {"backend": "tp-toy", "tensor_parallel_size": 2}))
    cases = [
        (
            _config(tmp_path, "mp-toy", {"backend": "whole-toy", "tensor_parallel_size": 2}),
            r"rollout.tensor_parallel_size: 2, but the 'whole-toy' rollout engine cannot split",
        ),
        (
            _config(
                tmp_path,
                "mp-toy",
                {"backend": "tp-toy", "tensor_parallel_size": 4},
                tp=2,
            ),
            r"rollout.tensor_parallel_size: 4 does not divide the actor's parallel.tp 2",
        ),
        (
            _config(tmp_path, "dp-toy", {"backend": "tp-toy", "tensor_parallel_size": 3}),
            r"must divide the actor's placement.processes = 4",
        ),
        (
            _config(tmp_path, "mp-toy", {"backend": "tp-toy", "pipeline_parallel_size": 2}),
            r"rollout.pipeline_parallel_size: 2, but the 'tp-toy' rollout engine cannot split",
        ),
        (
            _config(
                tmp_path, "dp-toy", {"backend": "tp-toy", "engine": {"tensor_parallel_size": 2}}
            ),
            r"rollout.engine.tensor_parallel_size: the parallel layout is not an engine "
            r"setting; use rollout.tensor_parallel_size",
        ),
        (
            _config(tmp_path, "mp-toy", WHOLE, engine={"tensor_parallel_size": 2}),
            r"actor.engine.tensor_parallel_size: the parallel layout is not an engine setting; "
            r"use actor.parallel.tp",
        ),
        (
            _config(tmp_path, "dp-toy", WHOLE, engine={"pipeline_parallel_size": 2}),
            r"actor.engine.pipeline_parallel_size: .*use actor.parallel.pp",
        ),
        (
            _config(tmp_path, "dp-toy", WHOLE, tp=2),
            r"actor.parallel.tp: 2, but the 'dp-toy' training engine cannot split a model",
        ),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError, match=message):
            preflight(config)


@pytest.mark.usefixtures("engines")
def test_sequence_parallel_sizes_are_checked_when_the_recipe_loads(tmp_path: Path) -> None:
    """``parallel.sp`` needs an engine declaring ``sp``, must divide the pool, and roles in
    the actor's workers split as the actor does; the engine receives the size."""
    from hf_core.roles.common import training_engine_args

    ok = _config(tmp_path, "sp-toy", WHOLE, sp=2)
    layout = preflight(ok)
    args = training_engine_args(ok, ok.actor, layout.role("actor"), head="lm", trainable=True)
    assert args["sequence_parallel_size"] == 2 and "tensor_parallel_size" not in args
    # a data-parallel engine beside a vLLM-style TP rollout stays unchecked against t_g
    preflight(_config(tmp_path, "sp-toy", {"backend": "tp-toy", "tensor_parallel_size": 2}))
    with_reference = ok.model_copy(
        update={
            "reference": ok.actor.model_copy(
                update={"parallel": ok.actor.parallel.model_copy(update={"sp": 1})}
            )
        }
    )
    cases = [
        (
            _config(tmp_path, "dp-toy", WHOLE, sp=2),
            r"actor.parallel.sp: 2, but the 'dp-toy' training engine cannot split a sequence",
        ),
        (
            _config(tmp_path, "sp-toy", WHOLE, sp=3),
            r"actor.parallel.sp: 3 ranks split each sequence; it must divide the actor's "
            r"pool of 4 processes",
        ),
        (
            with_reference,
            r"reference.parallel.sp: 1, but the reference runs in the actor's workers",
        ),
        (
            _config(tmp_path, "sp-toy", WHOLE, engine={"sequence_parallel_size": 2}),
            r"actor.engine.sequence_parallel_size: .*use actor.parallel.sp",
        ),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError, match=message):
            preflight(config)


@pytest.mark.usefixtures("engines")
def test_the_resolved_layout_reaches_the_engines(tmp_path: Path) -> None:
    """Core hands each engine the sizes of the axes it declares, from ``parallel`` and
    ``rollout.tensor_parallel_size``; a data-parallel engine gets none."""
    from hf_core.roles.common import rollout_engine_args, training_engine_args

    config = _config(tmp_path, "mp-toy", {"backend": "tp-toy", "tensor_parallel_size": 2}, tp=2)
    layout = resolve_layout(config)
    args = training_engine_args(
        config, config.actor, layout.role("actor"), head="lm", trainable=True
    )
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (2, 1)
    assert rollout_engine_args(config, layout.generation)["tensor_parallel_size"] == 2
    plain = _config(tmp_path, "dp-toy", {"backend": "whole-toy"})
    whole = resolve_layout(plain)
    assert "tensor_parallel_size" not in training_engine_args(
        plain, plain.actor, whole.role("actor"), head="lm", trainable=True
    )
    assert "tensor_parallel_size" not in rollout_engine_args(plain, whole.generation)
