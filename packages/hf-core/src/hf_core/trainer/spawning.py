"""Spawn the role worker groups a config asks for, over one or more resource pools.

Roles listed in one pool share its processes (hybrid colocation); separate pools are separate
processes (split placement).  The reference policy always lives in the actor's worker.
A standalone placement adds a ``rollout`` pool of rollout workers (the actor then holds no
rollout engine).  The workers get the run's layout as the driver resolved it, beside their
config (:func:`role_specs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hf_core.config import TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.roles import (
    ActorRolloutRefWorker,
    CriticWorker,
    JudgeWorker,
    RolloutWorker,
    ScoreModelWorker,
)
from hf_core.runtime import ResourcePool, RoleSpec, WorkerGroup, spawn
from hf_core.runtime.cluster import resolve_use_gpu


@dataclass(frozen=True)
class PoolSpec:
    """Roles (``actor``, ``critic``, ``reward``, ``cost``, ``rollout``) sharing ``processes``
    ranks."""

    roles: tuple[str, ...]
    processes: int


@dataclass
class RoleGroups:
    actor_group: WorkerGroup | None
    """The actor's workers; ``None`` only where no policy is trained (``trainer:
    reward_model``), so every other run reads :attr:`actor`."""
    critic: WorkerGroup | None = None
    reward: WorkerGroup | None = None
    cost: WorkerGroup | None = None
    rollout: WorkerGroup | None = None
    """The standalone rollout pool's workers (``None``: the actor generates itself)."""
    pools: list[ResourcePool] = field(default_factory=list)

    @property
    def actor(self) -> WorkerGroup:
        if self.actor_group is None:
            raise RuntimeError("this run has no actor workers (trainer: reward_model)")
        return self.actor_group

    def shutdown(self) -> None:
        groups = [self.actor_group, self.critic, self.reward, self.cost, self.rollout]
        _shutdown(groups, self.pools)


def _shutdown(groups: Sequence[WorkerGroup | None], pools: Sequence[ResourcePool]) -> None:
    """Kill each group's processes once (colocated roles share them), release the bundles."""
    seen: set[int] = set()
    for group in groups:
        if group is not None and id(group.processes) not in seen:
            seen.add(id(group.processes))
            group.shutdown()
    for pool in pools:
        pool.release()


def worker_roles(config: TrainerConfig) -> tuple[str, ...]:
    """The roles the config asks workers for, in :func:`role_specs`' order (the reference
    lives in the actor's worker; a generative judge fills the reward role's place).  The
    supervised and preference trainers train one model: the actor, or (``trainer:
    reward_model``) the reward model."""
    if config.trainer != "rl":
        return ("reward",) if config.trainer == "reward_model" else ("actor",)
    wanted = {
        "actor": True,
        "critic": config.critic is not None,
        "reward": config.reward.model is not None or config.reward.judge is not None,
        "cost": config.cost is not None and config.cost.model is not None,
        "rollout": config.placement.mode == "standalone",
    }
    return tuple(role for role, used in wanted.items() if used)


def role_specs(config: TrainerConfig, layout: RunLayout) -> dict[str, RoleSpec]:
    """The worker of every role the config uses.  The workers that build engines get
    ``layout``, the run's layout resolved on the driver: it reaches them pickled with the
    config, so no worker resolves it again."""
    if config.trainer == "reward_model" and config.reward.model is not None:
        return {
            "reward": RoleSpec(ScoreModelWorker, (config, config.reward.model, "reward", layout))
        }
    specs = {"actor": RoleSpec(ActorRolloutRefWorker, (config, layout))}
    if config.trainer != "rl":
        return specs
    if config.critic is not None:
        specs["critic"] = RoleSpec(CriticWorker, (config, layout))
    if config.reward.model is not None:
        specs["reward"] = RoleSpec(
            ScoreModelWorker, (config, config.reward.model, "reward", layout)
        )
    elif config.reward.judge is not None:  # a judge fills the reward role's place
        specs["reward"] = RoleSpec(JudgeWorker, (config, config.reward.judge))
    if config.cost is not None and config.cost.model is not None:
        specs["cost"] = RoleSpec(ScoreModelWorker, (config, config.cost.model, "cost", layout))
    if config.placement.mode == "standalone":
        specs["rollout"] = RoleSpec(RolloutWorker, (config, layout))
    return specs


def configured_pools(config: TrainerConfig) -> list[PoolSpec]:
    """Pools for ``colocate`` and ``split`` (``auto`` comes from the planner)."""
    roles = worker_roles(config)
    placement = config.placement
    if placement.mode == "standalone":
        models = tuple(r for r in roles if r != "rollout")
        return [
            PoolSpec(models, placement.processes),
            PoolSpec(("rollout",), placement.rollout_processes),
        ]
    if placement.mode == "colocate" or roles == ("actor",):
        return [PoolSpec(roles, placement.processes)]
    if placement.mode == "split":
        return [
            PoolSpec(("actor",), placement.processes),
            PoolSpec(roles[1:], placement.other_processes),
        ]
    raise ValueError(f"placement.mode={placement.mode!r} has no fixed pools")


def _per_node(processes: int, nodes: int) -> list[int]:
    """A pool's ranks spread evenly over ``nodes`` Ray nodes (the config checks they divide
    for fixed pools; a planner's pool may not)."""
    if processes % nodes:
        raise ValueError(
            f"placement.nodes={nodes} does not divide a pool of {processes} ranks: each node "
            "gets the same number of ranks"
        )
    return [processes // nodes] * nodes


def spawn_roles(
    config: TrainerConfig,
    layout: RunLayout,
    pools: Sequence[PoolSpec],
    *,
    stacks_dir: str | None = None,
) -> RoleGroups:
    """One process per rank; every role of a pool shares its processes.

    ``layout``: the run's layout (the recipe's as resolved by the pre-start checks, or the
    planner's), handed to the workers.  ``stacks_dir``: where every rank's Python stacks are
    dumped when one is lost or hangs (the trainer passes ``<output_dir>/stacks``).
    """
    specs = role_specs(config, layout)
    placed = sorted(r for pool in pools for r in pool.roles)
    if placed != sorted(specs):
        raise ValueError(f"pools place roles {placed}, but the config has {sorted(specs)}")
    groups: dict[str, WorkerGroup] = {}
    resource_pools: list[ResourcePool] = []
    use_gpu = resolve_use_gpu(config.cluster.use_gpu)
    try:
        for i, pool in enumerate(pools):
            name = "_".join(pool.roles) if i else "main"
            resource = ResourcePool(
                _per_node(pool.processes, config.placement.nodes),
                use_gpu=use_gpu,
                name=name,
            )
            resource_pools.append(resource)
            groups.update(
                spawn(
                    resource,
                    {r: specs[r] for r in pool.roles},
                    name=name,
                    failure_timeout_s=config.cluster.failure_timeout_s,
                    stacks_dir=stacks_dir,
                )
            )
    except BaseException:
        _shutdown(list(groups.values()), resource_pools)  # nothing half-started stays up
        raise
    return RoleGroups(
        actor_group=groups.get("actor"),
        critic=groups.get("critic"),
        reward=groups.get("reward"),
        cost=groups.get("cost"),
        rollout=groups.get("rollout"),
        pools=resource_pools,
    )
