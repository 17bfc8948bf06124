"""``placement.mode: auto``: ask the auto-mapping planner (paper §6) for the pools.

The planner sees the run's own dataflow (which roles exist and what each does per stage), each
model's shape from its ``config.json``, the workload from the data and rollout settings, and
``placement.devices`` devices of profile ``placement.device``.  The reference policy shares the
actor's worker here, so only placements keeping the two together are searched.  Parallel sizes
the plan picks (t, p, t_g) apply to backends that have them; a data-parallel backend such as
FSDP uses all of its pool's ranks for data parallelism.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from hf_core.algorithms import get_estimator_traits
from hf_core.config import TrainerConfig
from hf_core.planner import (
    Dataflow,
    Op,
    Workload,
    from_hf_config,
    make_cluster,
    plan,
    plan_table,
    plan_to_placement,
    set_partitions,
)
from hf_core.trainer.spawning import PoolSpec, role_specs

log = logging.getLogger(__name__)


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


def _model_configs(config: TrainerConfig, roles: list[str]) -> dict[str, Any]:
    paths = {"actor": config.role_model(config.actor)}
    if config.reference is not None:
        paths["reference"] = config.role_model(config.reference)
    if config.critic is not None:
        paths["critic"] = config.role_model(config.critic)
    if config.reward.model is not None:
        paths["reward"] = config.role_model(config.reward.model)
    if config.cost is not None and config.cost.model is not None:
        paths["cost"] = config.role_model(config.cost.model)
    return {
        role: from_hf_config(
            json.loads((Path(paths[role]) / "config.json").read_text()), name=Path(paths[role]).name
        )
        for role in roles
    }


def plan_pools(config: TrainerConfig, output_dir: Path) -> list[PoolSpec]:
    """Run the planner, log and save the chosen plan, and return the pools to spawn."""
    worker_roles = list(role_specs(config))
    roles = worker_roles + (["reference"] if config.reference is not None else [])
    devices = config.placement.devices or config.placement.processes
    workload = Workload(
        global_batch=config.data.batch_size,
        prompt_length=config.data.max_prompt_length or 64,
        response_length=config.rollout.max_new_tokens,
        ppo_epochs=config.algorithm.ppo_epochs,
        mini_batches=config.algorithm.mini_batches,
        samples_per_prompt=config.rollout.n,
    )
    dataflow = _dataflow(config, roles)
    placements = [
        p
        for p in set_partitions(list(dataflow.roles))
        if not any(("actor" in s) != ("reference" in s) for s in p)
    ]
    cluster = make_cluster(nodes=1, devices_per_node=devices, device=config.placement.device)
    best = plan(
        dataflow, _model_configs(config, roles), workload, cluster, top_k=1, placements=placements
    )[0]
    Console(stderr=True, width=140).print(plan_table(best))
    placement = plan_to_placement(best)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "plan.json").write_text(json.dumps(placement, indent=2))
    log.info("auto placement: %s (written to %s)", best.kind, output_dir / "plan.json")
    pools = []
    samples = config.data.batch_size * config.rollout.n
    for pool in placement["pools"]:
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
