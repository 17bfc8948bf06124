"""``placement.mode: auto``: ask the auto-mapping planner (paper §6) for pools and layouts.

The planner sees the run's own dataflow (which roles exist and what each does per stage), each
model's shape from its ``config.json``, the workload from the data and rollout settings, and
``placement.devices`` devices of profile ``placement.device``.  The reference policy shares the
actor's worker here, so only placements keeping the two together are searched.

It proposes only layouts the chosen backends can run: each role's training engine declares its
model-parallel axes (:func:`hf_core.plugins.get_engine_parallelism`), so a data-parallel
backend such as FSDP gets ``t = p = 1`` and uses all of its pool's ranks for data parallelism,
and the rollout engine's axes decide whether the generation TP ``t_g`` may exceed 1.  A size
the user set explicitly (a role's ``parallel.tp`` / ``parallel.pp``,
``rollout.tensor_parallel_size``) is respected: the search is constrained to it.  A role's
``parallel.sp`` (sequence parallelism) is the user's choice: the planner keeps it as set.
Roles on the same model-parallel backend share one ``(t, p)`` when colocated, because such
engines (megatron-core) keep their process groups in process-wide state.

The planner starts from the recipe's layout as the pre-start checks resolved it (the sizes it
keeps: ``sp``, ``p_g``).  The result is applied, not just printed: :func:`plan_pools` returns
the pools to spawn, the plan's :class:`~hf_core.config.layout.RunLayout` and a copy of the
config stating that layout the way a hand-written recipe would (each role's ``parallel``,
``rollout.tensor_parallel_size`` = ``t_g``), so :func:`hf_core.config.layout.resolve_layout`
would read both the same way -- the run takes the plan's layout as it is, without resolving
the applied recipe again; ``plan.json`` records it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from hf_core.algorithms import get_estimator_traits
from hf_core.config import ModelRoleConfig, TrainerConfig, validate
from hf_core.config.layout import (
    MODEL_AXES,
    RunLayout,
    TrainingLayout,
    fixed_sizes,
    model_roles,
    with_layout,
)
from hf_core.planner import (
    Dataflow,
    Op,
    Plan,
    RoleParallelism,
    Workload,
    from_hf_config,
    make_cluster,
    plan,
    plan_table,
    plan_to_placement,
    set_partitions,
)
from hf_core.plugins import get_engine_parallelism
from hf_core.resharding import GenerationLayout
from hf_core.trainer.preflight import preflight
from hf_core.trainer.spawning import PoolSpec, configured_pools, worker_roles

log = logging.getLogger(__name__)

ROLE_KEYS = {
    "actor": "actor",
    "reference": "reference",
    "critic": "critic",
    "reward": "reward.model",
    "cost": "cost.model",
}
"""Where each planner role's ``ModelRoleConfig`` sits in the recipe (dotted key)."""


@dataclass(frozen=True)
class AutoPlacement:
    """What a run spawns: the pools, the config whose engine settings follow the plan, and
    its layout (what the role workers receive).

    ``plan`` is what ``plan.json`` holds (``None`` for ``colocate`` / ``split``).
    """

    pools: list[PoolSpec]
    config: TrainerConfig
    layout: RunLayout
    plan: dict[str, Any] | None = None


def place_roles(config: TrainerConfig, layout: RunLayout, output_dir: Path) -> AutoPlacement:
    """Pools, effective config and layout for any ``placement.mode`` (``layout``: the recipe's,
    as :func:`~hf_core.trainer.preflight.preflight` resolved it; only ``auto`` changes them)."""
    if config.placement.mode == "auto":
        return plan_pools(config, layout, output_dir)
    return AutoPlacement(configured_pools(config), config, layout)


def _dataflow(config: TrainerConfig, roles: list[str]) -> Dataflow:
    extra = 1 if get_estimator_traits(config.algorithm.advantage).needs_greedy_baseline else 0
    prep = [Op("actor", "infer")]
    prep += [
        Op(r, "infer", extra_per_prompt=extra if r == "reward" else 0)
        for r in roles
        if r != "actor"
    ]
    train = [Op("actor", "train")] + ([Op("critic", "train")] if "critic" in roles else [])
    return Dataflow(
        name=f"{config.algorithm.advantage}-run",
        stages=(
            ("generation", (Op("actor", "generate", extra_per_prompt=extra),)),
            ("preparation", tuple(prep)),
            ("training", tuple(train)),
        ),
    )


def role_configs(config: TrainerConfig) -> dict[str, ModelRoleConfig]:
    """Each model role the config uses, by planner role name."""
    roles = model_roles(config)
    return {role: roles[key] for role, key in ROLE_KEYS.items() if key in roles}


def _model_configs(config: TrainerConfig, roles: list[str]) -> dict[str, Any]:
    configs = role_configs(config)
    paths = {role: Path(config.role_model(configs[role])) for role in roles}
    return {
        role: from_hf_config(json.loads((path / "config.json").read_text()), name=path.name)
        for role, path in paths.items()
    }


def _generation_tp(layout: RunLayout, fixed_tg: int | None) -> int | None:
    """``t_g`` the user fixed; the planner plans generation without pipeline stages."""
    p_g = layout.generation.pp
    if p_g != 1:
        raise ValueError(
            f"rollout.pipeline_parallel_size={p_g}: placement auto plans generation without "
            "pipeline stages (p_g = 1)"
        )
    return fixed_tg


def role_parallelism(
    config: TrainerConfig, layout: RunLayout, roles: list[str]
) -> dict[str, RoleParallelism]:
    """What each role's engines can run, as the planner's constraint input (``layout``: the
    recipe's resolved layout).

    Training axes come from the role's backend, generation axes (actor) from the rollout
    backend; explicit sizes in the config are fixed; roles on one model-parallel backend
    share their layout when colocated.
    """
    configs = role_configs(config)
    fixed, fixed_tg = fixed_sizes(config)
    out = {}
    for role in roles:
        rc = configs[role]
        where = ROLE_KEYS[role] + ".parallel"
        axes = get_engine_parallelism("training", rc.backend) & MODEL_AXES  # what it searches
        generation = frozenset[str]()
        tg = None
        if role == "actor":
            generation = get_engine_parallelism("rollout", config.rollout.backend)
            tg = _generation_tp(layout, fixed_tg)
        sizes = fixed.get(ROLE_KEYS[role], {})
        try:
            out[role] = RoleParallelism(
                axes=axes,
                generation_axes=generation,
                tp=sizes.get("tp"),
                pp=sizes.get("pp"),
                generation_tp=tg,
                shared_layout=rc.backend if axes else None,
            )
        except ValueError as exc:
            raise ValueError(
                f"{where} (training backend {rc.backend!r}, rollout backend "
                f"{config.rollout.backend!r}): {exc}"
            ) from None
    return out


def _workload(config: TrainerConfig) -> Workload:
    return Workload(
        global_batch=config.data.batch_size,
        prompt_length=config.data.max_prompt_length or 64,
        response_length=config.rollout.max_new_tokens,
        ppo_epochs=config.algorithm.ppo_epochs,
        mini_batches=config.algorithm.mini_batches,
        samples_per_prompt=config.rollout.n,
    )


def best_plan(config: TrainerConfig, layout: RunLayout) -> Plan:
    """The planner's best plan for this run, restricted to what its backends can run
    (``layout``: the recipe's resolved layout)."""
    roles = [*worker_roles(config), *(["reference"] if config.reference is not None else [])]
    devices = config.placement.devices or config.placement.processes
    dataflow = _dataflow(config, roles)
    placements = [
        p
        for p in set_partitions(list(dataflow.roles))
        if not any(("actor" in s) != ("reference" in s) for s in p)
    ]
    cluster = make_cluster(nodes=1, devices_per_node=devices, device=config.placement.device)
    return plan(
        dataflow,
        _model_configs(config, roles),
        _workload(config),
        cluster,
        top_k=1,
        placements=placements,
        parallelism=role_parallelism(config, layout, roles),
    )[0]


def plan_layout(layout: RunLayout, chosen: Plan) -> RunLayout:
    """The run layout the plan implies for a recipe of ``layout``: each role's ``(t, p)`` (a
    data-parallel backend only ever gets ``1, 1`` from the constrained search), its ``sp`` as
    the recipe set it, and the actor's ``t_g``."""
    keys = {ROLE_KEYS[role]: model.layout for role, model in chosen.models.items()}
    training = tuple(
        (
            key,
            TrainingLayout(tp=keys[key].tp, pp=keys[key].pp, sp=sizes.sp, ep=sizes.ep)
            if key in keys
            else TrainingLayout(sp=sizes.sp, ep=sizes.ep),
        )
        for key, sizes in layout.training
    )
    actor = chosen.models["actor"]
    tg = actor.generation.tp if actor.generation is not None else 1
    return RunLayout(training=training, generation=GenerationLayout(pp=1, tp=tg))


def apply_plan(config: TrainerConfig, planned: RunLayout, chosen: Plan) -> TrainerConfig:
    """A re-validated copy of ``config`` running the plan: each role's ``parallel`` and
    ``rollout.tensor_parallel_size`` state ``planned`` (:func:`plan_layout`), and
    ``placement.processes`` is the actor pool's size.  Checked with ``planned`` as its layout
    (resolving the copy would give the same)."""
    data = with_layout(config.model_dump(), planned)
    actor_pool = next(p for p in chosen.pools if "actor" in p.roles)
    data["placement"]["processes"] = actor_pool.devices
    applied = validate(TrainerConfig, data, "placement auto (the planner's layout)")
    preflight(applied, planned)  # the engines' own settings models accept the sizes
    return applied


def _plan_record(config: TrainerConfig, chosen: Plan, layout: RunLayout) -> dict[str, Any]:
    """``plan.json``: the planner's placement plus the layout each engine runs (``layout``,
    the plan's: :func:`plan_layout`)."""
    record = plan_to_placement(chosen)
    configs = role_configs(config)
    engines: dict[str, Any] = {}
    for role, rc in configs.items():
        if role not in chosen.models:
            continue
        sizes = layout.role(ROLE_KEYS[role])
        axes = get_engine_parallelism("training", rc.backend)
        engines[role] = {
            "backend": rc.backend,
            "parallel_axes": sorted(axes),
            "tp": sizes.tp,
            "pp": sizes.pp,
            "sp": sizes.sp,
        }
    engines["rollout"] = {
        "backend": config.rollout.backend,
        "parallel_axes": sorted(get_engine_parallelism("rollout", config.rollout.backend)),
        "tensor_parallel_size": layout.generation.tp,
        "pipeline_parallel_size": layout.generation.pp,
    }
    record["engines"] = engines
    return record


def _pools(config: TrainerConfig, record: Mapping[str, Any]) -> list[PoolSpec]:
    """Worker pools from the plan (the reference lives in the actor's worker)."""
    pools = []
    samples = config.data.batch_size * config.rollout.n
    for pool in record["pools"]:
        pool_roles = tuple(r for r in pool["roles"] if r != "reference")
        parts = pool["devices"] * config.algorithm.mini_batches
        if samples % parts:
            raise ValueError(
                f"the planner put {pool_roles} on {pool['devices']} ranks, but "
                f"data.batch_size * rollout.n = {samples} does not split into {parts} parts; "
                "choose a batch size divisible by every device count up to placement.devices"
            )
        pools.append(PoolSpec(pool_roles, pool["devices"]))
    return pools


def plan_pools(config: TrainerConfig, layout: RunLayout, output_dir: Path) -> AutoPlacement:
    """Run the planner for a recipe of ``layout`` (its resolved layout), log and save the
    chosen plan, and return the pools to spawn with the config that applies the plan's
    parallel sizes and the plan's layout."""
    chosen = best_plan(config, layout)
    Console(stderr=True, width=140).print(plan_table(chosen))
    planned = plan_layout(layout, chosen)
    record = _plan_record(config, chosen, planned)
    pools = _pools(config, record)
    applied = apply_plan(config, planned, chosen)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "plan.json").write_text(json.dumps(record, indent=2))
    log.info(
        "auto placement: %s, engines %s (written to %s)",
        chosen.describe(),
        record["engines"],
        output_dir / "plan.json",
    )
    return AutoPlacement(pools, applied, planned, record)
