"""``placement: auto`` turns the planner's layout into the recipe layout the run is spawned with.

Toy engines are registered with the axes real backends declare (megatron: tp+pp training and
tp rollout; FSDP / HF: data parallel only), so the constraints and the applied config are
checked without installing any backend.  The model is the recipes' tiny policy shape (only its
``config.json`` is read); a device profile with a few MiB of memory makes splitting it needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hf_core import plugins
from hf_core.config import TrainerConfig, validate
from hf_core.config.layout import TrainingLayout, resolve_layout
from hf_core.planner import PROFILES, Plan
from hf_core.resharding import GenerationLayout
from hf_core.trainer.auto_placement import (
    apply_plan,
    best_plan,
    place_roles,
    plan_layout,
    plan_pools,
    role_parallelism,
)
from hf_core.trainer.spawning import PoolSpec

TINY = {
    "model_type": "qwen2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
AXES = {
    ("training", "megatron-toy"): ("tp", "pp"),
    ("training", "fsdp-toy"): (),
    ("rollout", "tp-toy"): ("tp",),
    ("rollout", "hf-toy"): (),
}


@pytest.fixture
def engines() -> Iterator[None]:
    """Toy engines registered like a plugin would, with the parallel axes real ones declare."""
    plugins.reset()
    reg = plugins.registry()
    for (kind, name), axes in AXES.items():
        table = reg.training_engines if kind == "training" else reg.rollout_engines
        parallel = (
            reg.training_engine_parallel if kind == "training" else reg.rollout_engine_parallel
        )
        table.add(name, dict, owner="test")
        parallel[name] = frozenset(axes)
    yield
    plugins.reset()


@pytest.fixture
def scaled_cpu(make_config: Callable[..., TrainerConfig], monkeypatch: pytest.MonkeyPatch) -> str:
    """A CPU profile whose memory lies halfway between what the best plan needs per device
    with the actor unsplit and split in two: only a model-parallel actor fits."""

    def peak(parallel: dict[str, int]) -> float:
        chosen = _best(make_config(actor={"parallel": parallel}))
        return max(pool.peak_bytes for pool in chosen.pools)

    unsplit = peak({"tp": 1, "pp": 1})
    split = min(peak({"tp": 2}), peak({"pp": 2}))
    assert split < unsplit
    cpu = PROFILES["cpu"]
    gib = (split + unsplit) / 2 / cpu.usable_memory_fraction / 2**30
    monkeypatch.setitem(
        PROFILES, "cpu-scaled", cpu.model_copy(update={"name": "CPU (scaled)", "memory_gib": gib})
    )
    return "cpu-scaled"


@pytest.fixture
def make_config(tmp_path: Path, engines: None) -> Callable[..., TrainerConfig]:
    """A PPO run (actor, reference, critic, rule reward) over 2 devices, with overrides."""
    for name in ("policy", "critic"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(TINY))

    def make(**sections: Any) -> TrainerConfig:
        data: dict[str, Any] = {
            "run": {"output_dir": str(tmp_path / "run")},
            "model": {"path": str(tmp_path / "policy")},
            "data": {"batch_size": 8},
            "placement": {"mode": "auto", "devices": 2, "device": "cpu"},
            "rollout": {"backend": "hf-toy", "max_new_tokens": 8},
            "actor": {"backend": "megatron-toy"},
            "reference": {"backend": "fsdp-toy"},
            "critic": {"backend": "fsdp-toy", "model_path": str(tmp_path / "critic")},
            "reward": {"function": "digits_reverse"},
            "algorithm": {"advantage": "gae", "mini_batches": 2},
        }
        for key, value in sections.items():
            data[key] = {**data.get(key, {}), **value}
        return validate(TrainerConfig, data)

    return make


def _best(config: TrainerConfig) -> Plan:
    """The best plan for the recipe's own resolved layout."""
    return best_plan(config, resolve_layout(config))


def _applied(config: TrainerConfig, chosen: Plan) -> TrainerConfig:
    """The recipe applying ``chosen`` (its layout as :func:`plan_pools` hands it down)."""
    return apply_plan(config, plan_layout(resolve_layout(config), chosen), chosen)


def _tp_pp(chosen: Any, role: str) -> tuple[int, int]:
    layout = chosen.models[role].layout
    return layout.tp, layout.pp


def test_constraints_follow_the_backends(make_config: Callable[..., TrainerConfig]) -> None:
    config = make_config(rollout={"backend": "tp-toy"})
    limits = role_parallelism(config, resolve_layout(config), ["actor", "critic", "reference"])
    assert limits["actor"].axes == {"tp", "pp"} and limits["actor"].generation_axes == {"tp"}
    assert limits["actor"].shared_layout == "megatron-toy"
    assert limits["critic"].axes == frozenset() and limits["critic"].shared_layout is None
    assert limits["actor"].tp is None and limits["actor"].generation_tp is None


def test_planned_split_is_applied_to_the_recipe_layout(
    make_config: Callable[..., TrainerConfig], scaled_cpu: str, tmp_path: Path
) -> None:
    config = make_config(placement={"device": scaled_cpu})
    placed = plan_pools(config, resolve_layout(config), tmp_path / "out")
    record = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert record == placed.plan
    actor = next(p for p in record["pools"] if "actor" in p["roles"])
    train = actor["layouts"]["actor"]["train"]
    assert train["tp"] * train["pp"] == 2  # the scaled device leaves no unsplit actor layout
    layout = placed.layout  # what the workers get: the plan's, not resolved again ...
    assert layout == resolve_layout(placed.config)  # ... and what the applied recipe states
    assert layout.role("actor") == TrainingLayout(tp=train["tp"], pp=train["pp"])
    assert (record["engines"]["actor"]["tp"], record["engines"]["actor"]["pp"]) == (
        train["tp"],
        train["pp"],
    )
    assert layout.role("critic") == TrainingLayout()  # FSDP-like: data parallel only
    assert placed.config.actor.engine == {}  # sizes are not engine settings
    assert layout.generation == GenerationLayout(pp=1, tp=1)  # no tp in the rollout engine
    assert placed.config.placement.processes == actor["devices"]
    assert placed.pools == [PoolSpec(tuple(r for r in actor["roles"] if r != "reference"), 2)]
    assert resolve_layout(config).role("actor") == TrainingLayout()  # the input is left alone


def test_user_fixed_sizes_constrain_the_search(make_config: Callable[..., TrainerConfig]) -> None:
    """On a roomy device the planner keeps the tiny actor whole; fixed sizes override that."""
    assert _tp_pp(_best(make_config()), "actor") == (1, 1)
    for parallel, expected in (
        ({"tp": 2}, (2, 1)),
        ({"pp": 2}, (1, 2)),
        ({"tp": 2, "pp": 1}, (2, 1)),
    ):
        config = make_config(actor={"parallel": parallel})
        chosen = _best(config)
        assert _tp_pp(chosen, "actor") == expected, parallel
        applied = resolve_layout(_applied(config, chosen)).role("actor")
        assert (applied.tp, applied.pp) == expected


def test_planner_and_hand_written_recipes_resolve_to_the_same_layout(
    make_config: Callable[..., TrainerConfig], scaled_cpu: str
) -> None:
    """A recipe stating by hand the layout the planner chose resolves to the same object as
    the planner's applied recipe: one spelling, one reader."""
    config = make_config(placement={"device": scaled_cpu}, rollout={"backend": "tp-toy"})
    planned = _applied(config, _best(config))
    by_planner = resolve_layout(planned)
    assert by_planner.role("actor").model_parallel_size == 2  # the scaled device splits it
    stated = {key: {"tp": sizes.tp, "pp": sizes.pp} for key, sizes in by_planner.training}
    by_hand = make_config(
        placement={"mode": "colocate", "processes": planned.placement.processes},
        rollout={"backend": "tp-toy", "tensor_parallel_size": by_planner.generation.tp},
        **{key: {"parallel": sizes} for key, sizes in stated.items()},
    )
    assert resolve_layout(by_hand) == by_planner
    assert resolve_layout(make_config()) != by_planner  # the comparison can fail


def test_generation_tp_applies_only_where_the_rollout_engine_has_tp(
    make_config: Callable[..., TrainerConfig],
) -> None:
    config = make_config(
        actor={"parallel": {"tp": 2}},
        rollout={"backend": "tp-toy", "tensor_parallel_size": 2},
    )
    applied = resolve_layout(_applied(config, _best(config)))
    assert applied.generation == GenerationLayout(pp=1, tp=2)
    assert applied.role("actor").tp == 2
    no_tp = make_config(rollout={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"actor\.parallel .*generation tp=2 is fixed"):
        _best(no_tp)


def test_tied_backends_share_one_layout(
    make_config: Callable[..., TrainerConfig], scaled_cpu: str
) -> None:
    """Two megatron-like roles in one process (actor and reference) get the same (t, p)."""
    config = make_config(placement={"device": scaled_cpu}, reference={"backend": "megatron-toy"})
    chosen = _best(config)
    assert _tp_pp(chosen, "actor") == _tp_pp(chosen, "reference")
    applied = _applied(config, chosen)
    layout = resolve_layout(applied)
    assert layout.role("reference") == layout.role("actor")


def test_impossible_requests_are_clear_errors(make_config: Callable[..., TrainerConfig]) -> None:
    with pytest.raises(ValueError, match=r"critic\.parallel .*'fsdp-toy'.*tp=2 is fixed"):
        _best(make_config(critic={"parallel": {"tp": 2}}))
    with pytest.raises(ValueError, match="p_g = 1"):
        _best(make_config(rollout={"pipeline_parallel_size": 2}))


def test_fixed_placements_pass_through(make_config: Callable[..., TrainerConfig]) -> None:
    config = make_config(placement={"mode": "colocate", "processes": 2})
    layout = resolve_layout(config)
    placed = place_roles(config, layout, Path("unused"))
    assert placed.config is config and placed.layout is layout and placed.plan is None
    assert placed.pools == [PoolSpec(("actor", "critic"), 2)]
