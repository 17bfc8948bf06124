"""``placement: auto`` applies the planner's layout: the engines spawned run the plan.

The planner's cost model never splits the tiny recipe model on an ordinary CPU profile (its
all-reduces cost more than they save), so the run plans over a device profile scaled down to
the tiny model: its memory lies halfway between what the planner's best colocated plan needs
per device with the actor unsplit and with it split two ways (a few MiB), so no unsplit actor
layout fits.  The planner then has to choose a model-parallel layout for the megatron actor by
itself (nothing in the recipe sets ``tensor_parallel_size``), while the FSDP roles can only be
data parallel.  The test reads the layout every spawned worker reports (megatron reports its
real process groups) and compares it with ``plan.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RECIPES

from hf_core.config import TrainerConfig, load_config
from hf_core.config.layout import TrainingLayout, resolve_layout
from hf_core.planner import PROFILES, DeviceProfile
from hf_core.planner.devices import GIB
from hf_core.protocols import WorkerMesh
from hf_core.trainer import RLTrainer
from hf_core.trainer.auto_placement import best_plan

pytest.importorskip("hf_megatron")

OVERRIDES = [
    "run.total_steps=2",
    "run.val_every=0",
    "run.progress=false",
    "run.save_final=false",
    "run.output_dir=runs/ppo_auto_megatron",
    "actor.backend=megatron",
]


def _peak_gib(extra: list[str]) -> float:
    """Per-device peak of the planner's best plan for the recipe on the plain ``cpu`` profile."""
    config = load_config(TrainerConfig, RECIPES / "ppo_auto.yaml", [*OVERRIDES, *extra])
    chosen = best_plan(config, resolve_layout(config))
    return max(pool.peak_bytes for pool in chosen.pools) / GIB


def small_device() -> DeviceProfile:
    """The ``cpu`` profile with memory between the split and the unsplit actor's needs."""
    cpu = PROFILES["cpu"]
    unsplit = _peak_gib(["actor.parallel.tp=1", "actor.parallel.pp=1"])
    split = min(_peak_gib(["actor.parallel.tp=2"]), _peak_gib(["actor.parallel.pp=2"]))
    assert split < unsplit, "splitting the actor must save memory in the cost model"
    usable = (split + unsplit) / 2
    return cpu.model_copy(
        update={"name": "CPU (scaled)", "memory_gib": usable / cpu.usable_memory_fraction}
    )


class LayoutRecorder(RLTrainer):
    """Records the config the run was spawned with and every worker's reported mesh."""

    spawned: dict[str, tuple[WorkerMesh, ...]]
    applied: TrainerConfig

    def _fit(self):  # type: ignore[no-untyped-def]
        groups = self._groups
        self.applied = self.config
        self.spawned = {
            role: group.meshes(refresh=True)
            for role, group in (("actor", groups.actor), ("critic", groups.critic))
            if group is not None
        }
        return super()._fit()


def _layout(pool_layouts: dict, role: str, kind: str) -> tuple[int, int, int]:
    lay = pool_layouts[role][kind]
    return lay["tp"], lay["pp"], lay["dp"]


@pytest.mark.usefixtures("ray_cluster")
def test_auto_placement_spawns_the_planned_megatron_layout(
    in_workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(PROFILES, "cpu-scaled", small_device())
    config = load_config(
        TrainerConfig, RECIPES / "ppo_auto.yaml", [*OVERRIDES, "placement.device=cpu-scaled"]
    )
    assert "parallel" not in config.actor.model_fields_set  # the planner must choose it
    trainer = LayoutRecorder(config)
    trainer.fit()

    plan = json.loads((config.run.output_dir / "plan.json").read_text())
    pools = {role: pool for pool in plan["pools"] for role in pool["roles"]}
    actor_pool = pools["actor"]
    tp, pp, dp = _layout(actor_pool["layouts"], "actor", "train")
    assert tp * pp == 2, "the scaled device leaves the planner no unsplit actor layout"
    assert tp * pp * dp == actor_pool["devices"]

    # the config the workers got carries the plan ...
    applied = trainer.applied
    layout = resolve_layout(applied)
    assert layout.role("actor") == TrainingLayout(tp=tp, pp=pp)
    assert plan["engines"]["actor"] == {
        "backend": "megatron",
        "parallel_axes": ["ep", "pp", "tp"],
        "tp": tp,
        "pp": pp,
        "sp": 1,  # sequence parallelism: the user's choice, kept as set
    }
    gen_tp = actor_pool["layouts"]["actor"]["generation"]["tp"]
    assert gen_tp == 1  # the transformers rollout engine declares no tensor parallelism
    assert layout.generation.tp == gen_tp
    assert layout.role("critic") == TrainingLayout()  # FSDP: data parallel only

    # ... and every spawned worker runs it
    actor_meshes = trainer.spawned["actor"]
    assert len(actor_meshes) == actor_pool["devices"]
    assert {(m.tp_size, m.pp_size, m.dp_size) for m in actor_meshes} == {(tp, pp, dp)}
    assert sorted((m.pp_rank, m.tp_rank, m.dp_rank) for m in actor_meshes) == sorted(
        (p, t, d) for p in range(pp) for t in range(tp) for d in range(dp)
    )
    assert {m.gen_tp_size for m in actor_meshes} == {gen_tp}
    critic_pool = pools["critic"]
    assert _layout(critic_pool["layouts"], "critic", "train") == (1, 1, critic_pool["devices"])
    critic_meshes = trainer.spawned["critic"]
    assert {(m.tp_size, m.pp_size, m.dp_size) for m in critic_meshes} == {
        (1, 1, critic_pool["devices"])
    }

    rows = [json.loads(line) for line in (config.run.output_dir / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all("actor/pg_loss" in row and "critic/vf_loss" in row for row in rows)
