"""Spawn the role worker groups a config asks for, colocated or split across two pools."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_core.config import TrainerConfig
from hf_core.runtime import ResourcePool, RoleSpec, WorkerGroup, spawn
from hf_core.workers import ActorRolloutRefWorker, CriticWorker, ScoreModelWorker


@dataclass
class RoleGroups:
    actor: WorkerGroup
    critic: WorkerGroup | None = None
    reward: WorkerGroup | None = None
    cost: WorkerGroup | None = None
    pools: list[ResourcePool] = field(default_factory=list)

    def shutdown(self) -> None:
        seen: set[int] = set()
        for group in (self.actor, self.critic, self.reward, self.cost):
            if group is not None and id(group.hosts) not in seen:
                seen.add(id(group.hosts))
                group.shutdown()
        for pool in self.pools:
            pool.release()


def _specs(config: TrainerConfig) -> tuple[dict[str, RoleSpec], dict[str, RoleSpec]]:
    """Roles for the actor's pool and for the other pool (empty when colocated)."""
    actor = {"actor": RoleSpec(ActorRolloutRefWorker, (config,))}
    others: dict[str, RoleSpec] = {}
    if config.critic is not None:
        others["critic"] = RoleSpec(CriticWorker, (config,))
    if config.reward.model is not None:
        others["reward"] = RoleSpec(ScoreModelWorker, (config, config.reward.model, "reward"))
    if config.cost is not None and config.cost.model is not None:
        others["cost"] = RoleSpec(ScoreModelWorker, (config, config.cost.model, "cost"))
    if config.placement.mode == "colocate":
        return {**actor, **others}, {}
    return actor, others


def spawn_roles(config: TrainerConfig) -> RoleGroups:
    """One process per rank; every role of a pool shares its processes (hybrid colocation)."""
    main_roles, other_roles = _specs(config)
    common = dict(failure_timeout_s=config.cluster.failure_timeout_s)
    use_gpu = config.cluster.use_gpu
    main_pool = ResourcePool([config.placement.processes], use_gpu=use_gpu, name="main")
    pools = [main_pool]
    groups = spawn(main_pool, main_roles, name="main", **common)
    if other_roles:
        other_pool = ResourcePool([config.placement.other_processes], use_gpu=use_gpu, name="other")
        pools.append(other_pool)
        groups.update(spawn(other_pool, other_roles, name="other", **common))
    return RoleGroups(
        actor=groups["actor"],
        critic=groups.get("critic"),
        reward=groups.get("reward"),
        cost=groups.get("cost"),
        pools=pools,
    )
