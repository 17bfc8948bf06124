"""Auto-mapping (HybridFlow §6, Algorithms 1 and 2): place, allocate and parallelise models.

Pure Python over an analytical cost model -- no torch, no Ray, no devices -- so a plan can be
computed anywhere, printed by ``hybridflow plan`` and handed to a runner as plain data.

>>> from hf_core.planner import make_cluster, plan
>>> best = plan("ppo", {r: "llama2-7b" for r in ("actor", "critic", "reference", "reward")},
...             {}, make_cluster(nodes=2, devices_per_node=8))[0]  # doctest: +SKIP
"""

from hf_core.planner.autoparallel import Candidate, RoleModel, RoleParallelism, auto_parallel
from hf_core.planner.dataflow import (
    DATAFLOWS,
    GRPO,
    PPO,
    REMAX,
    SAFE_RLHF,
    Dataflow,
    Op,
    get_dataflow,
)
from hf_core.planner.devices import (
    PROFILES,
    DeviceCluster,
    DeviceProfile,
    calibrate,
    device_profile,
    make_cluster,
)
from hf_core.planner.models import PRESETS, ModelSpec, from_hf_config, load_model, preset
from hf_core.planner.placement import allocations, allowed_sizes, bell, set_partitions
from hf_core.planner.plan import ModelPlan, Plan, PoolPlan, plan_to_placement
from hf_core.planner.recipe import PlanRecipe, load_recipe
from hf_core.planner.render import plan_table, summary_table, to_text
from hf_core.planner.score import aggregate
from hf_core.planner.search import Planner, plan
from hf_core.planner.workload import Workload

__all__ = [
    "DATAFLOWS",
    "GRPO",
    "PPO",
    "PRESETS",
    "PROFILES",
    "REMAX",
    "SAFE_RLHF",
    "Candidate",
    "Dataflow",
    "DeviceCluster",
    "DeviceProfile",
    "ModelPlan",
    "ModelSpec",
    "Op",
    "Plan",
    "PlanRecipe",
    "Planner",
    "PoolPlan",
    "RoleModel",
    "RoleParallelism",
    "Workload",
    "aggregate",
    "allocations",
    "allowed_sizes",
    "auto_parallel",
    "bell",
    "calibrate",
    "device_profile",
    "from_hf_config",
    "get_dataflow",
    "load_model",
    "load_recipe",
    "make_cluster",
    "plan",
    "plan_table",
    "plan_to_placement",
    "preset",
    "set_partitions",
    "summary_table",
    "to_text",
]
