"""Before a run starts: does the actor's process fit the memory of this machine?

A run that cannot fit used to be killed by the kernel minutes in (while loading, or in the
first update), and a self-healing restart walked into the same death.  This check adds up
what one actor process holds at its peak -- the actor's training state sharded over the
pool, a colocated reference, critic and reward model, the rollout engine's copy of the
weights and what its settings declare beyond them (KV cache, its own runtime), the runtime,
and the smallest update it can make (one sample, activations recomputed) -- with the
estimate of :mod:`hf_core.engines.memory_fit`, and refuses to start when even that exceeds
the process's share of the machine, naming the estimate's parts and the budget.  Training
engines choose their micro-batches within what is left at run time
(``max_tokens_per_micro_batch: auto``).

Only where the figures mean something: a local CPU run (no Ray cluster to join, one node);
GPU memory and other machines are not visible from here.
"""

from __future__ import annotations

import os
from typing import Any, get_args

from hf_core.config import TrainerConfig
from hf_core.config.layout import RunLayout, TrainingLayout
from hf_core.engines.capabilities import (
    DeclaresHostOverhead,
    DeclaresNodeSharedMemory,
    DeclaresTrainingState,
)
from hf_core.engines.dtypes import DTypeName, to_dtype
from hf_core.engines.hf_folder import read_model_config
from hf_core.engines.memory_fit import (
    RUNTIME_BYTES,
    MicroBatchFit,
    TrainingFootprint,
    fit_micro_batch,
    process_budget_bytes,
    size_text,
)
from hf_core.engines.top_k import top_k_bytes_per_token
from hf_core.errors import MemoryFitError
from hf_core.planner.models import ModelSpec, from_hf_config
from hf_core.plugins import validated_engine_settings
from hf_core.resharding import GenerationLayout
from hf_core.roles.common import rollout_engine_args, training_engine_args


def _bytes(engine: dict[str, Any], *keys: str) -> int:
    """Bytes per element of the dtype named by the first of ``keys`` the engine block sets
    to a dtype name (``mixed_precision: auto`` or ``none`` names none); float32 otherwise."""
    for key in keys:
        if str(engine.get(key)) in get_args(DTypeName):
            return to_dtype(str(engine[key])).itemsize
    return 4


def _spec(config: TrainerConfig, role: Any, key: str) -> ModelSpec:
    folder = config.role_model(role)
    return from_hf_config(read_model_config(folder, key=key), name=str(folder))


def _training_settings(
    config: TrainerConfig, role: Any, sizes: TrainingLayout, *, trainable: bool
) -> Any:
    """The role's training-engine settings, validated (None: not installed here)."""

    def block() -> dict[str, Any]:
        args = training_engine_args(config, role, sizes, head="lm", trainable=trainable)
        return {**args, **role.engine}

    return validated_engine_settings("training", role.backend, block)


def _node_shared_share(config: TrainerConfig, layout: RunLayout, per_node: int) -> int:
    """One process's share of what the actor engine's ranks on a node hold together
    (:class:`~hf_core.engines.DeclaresNodeSharedMemory`; e.g. FSDP's shared-memory file)."""
    settings = _training_settings(config, config.actor, layout.role("actor"), trainable=True)
    if not isinstance(settings, DeclaresNodeSharedMemory):
        return 0
    return settings.node_shared_bytes(per_node) // per_node


def _declared_state_bytes(
    config: TrainerConfig,
    role: Any,
    sizes: TrainingLayout,
    spec: ModelSpec,
    ranks: int,
    *,
    trainable: bool,
    weights_only: bool = False,
) -> int | None:
    """What the role's engine settings declare for one rank's weights, gradients and
    optimizer state (:class:`~hf_core.engines.DeclaresTrainingState`), or None.
    ``weights_only``: a trained engine whose base weights are frozen (LoRA)."""

    settings = _training_settings(config, role, sizes, trainable=trainable)
    if not isinstance(settings, DeclaresTrainingState):
        return None
    return settings.state_bytes_per_rank(spec.num_params, ranks, trainable and not weights_only)


def _frozen_bytes(
    config: TrainerConfig, role: Any, sizes: TrainingLayout, spec: ModelSpec, ranks: int
) -> int:
    declared = _declared_state_bytes(config, role, sizes, spec, ranks, trainable=False)
    if declared is not None:
        return declared
    return _bytes(role.engine, "param_dtype", "dtype") * spec.num_params // ranks


def rollout_overhead_bytes(
    config: TrainerConfig, generation: GenerationLayout, *, training: bool = False
) -> int:
    """What the rollout engine (built with the run's ``generation`` layout) holds beyond its
    weights (``training``: while the actor updates): its settings' own estimate when they
    declare one (:class:`~hf_core.engines.DeclaresHostOverhead`), else an explicit
    ``kv_cache_bytes``."""
    rollout = config.rollout
    settings = validated_engine_settings(
        "rollout",
        rollout.backend,
        lambda: {**rollout_engine_args(config, generation), **rollout.engine},
    )
    if isinstance(settings, DeclaresHostOverhead):
        return settings.training_overhead_bytes() if training else settings.host_overhead_bytes()
    return int(rollout.engine.get("kv_cache_bytes", 0) or 0)


def actor_process_fit(
    config: TrainerConfig, layout: RunLayout, node_bytes: int | None = None
) -> MicroBatchFit:
    """The smallest update of one actor process and the budget it has (see the module); the
    rollout engine counts what it keeps while the actor trains.  ``layout``: the run's
    resolved layout."""
    return _actor_process(config, layout, node_bytes)[0]


def _actor_process(
    config: TrainerConfig, layout: RunLayout, node_bytes: int | None
) -> tuple[MicroBatchFit, int]:
    """The update's fit, and what the rollout engine adds back while generating (what it
    hands back during training)."""
    placement = config.placement
    ranks = placement.processes
    spec = _spec(config, config.actor, "actor.model_path")
    engine = config.actor.engine
    lora = engine.get("lora") is not None
    param = _bytes(engine, "param_dtype")
    footprint = TrainingFootprint(
        spec=spec,
        ranks=ranks,
        param_bytes=param,
        compute_bytes=min(param, _bytes(engine, "mixed_precision", "param_dtype")),
        trainable=not lora,
        declared_state_bytes=_declared_state_bytes(
            config,
            config.actor,
            layout.role("actor"),
            spec,
            ranks,
            trainable=True,
            weights_only=lora,
        ),
    )
    resident = RUNTIME_BYTES  # LoRA's frozen base weights are the footprint's state
    rollout_growth = 0
    if config.reference is not None and not lora:
        resident += _frozen_bytes(config, config.reference, layout.role("reference"), spec, ranks)
    if config.teacher is not None:  # another model: its own size
        teacher = _spec(config, config.teacher, "teacher.model_path")
        resident += _frozen_bytes(config, config.teacher, layout.role("teacher"), teacher, ranks)
        resident += teacher_top_k_bytes(config, layout, teacher.vocab_size)
    if placement.mode != "standalone":  # the rollout engine lives in this process
        generation = layout.generation
        shards = generation.tp * generation.pp
        resident += _bytes(config.rollout.engine, "dtype") * spec.num_params // shards
        while_training = rollout_overhead_bytes(config, generation, training=True)
        resident += while_training
        rollout_growth = rollout_overhead_bytes(config, generation) - while_training
    elif config.rollout.sync == "delta":  # rank 0's copy of what it last sent, in the wire dtype
        resident += _bytes(config.rollout.engine, "dtype") * spec.num_params
    if placement.mode == "colocate":
        if config.critic is not None:
            critic = _spec(config, config.critic, "critic.model_path").with_value_head()
            resident += 4 * _bytes(config.critic.engine, "param_dtype") * critic.num_params // ranks
    per_node = max(1, ranks // placement.nodes)
    resident += _node_shared_share(config, layout, per_node)
    budget = process_budget_bytes(per_node, node_bytes)
    sp = layout.role("actor").sp  # a sequence-parallel rank holds its share
    sample = -(-(config.rollout.max_new_tokens + 1) // sp)
    fit = fit_micro_batch(
        footprint, budget, resident_bytes=resident, checkpointing=True, min_tokens=sample
    )
    return fit, rollout_growth


def teacher_top_k_bytes(config: TrainerConfig, layout: RunLayout, vocab_size: int) -> int:
    """What one actor process holds of the step's teacher top-k (top-k distillation): its
    share of the batch's response tokens times ``k`` ids and log-probs each
    (:func:`~hf_core.engines.top_k.top_k_bytes_per_token`); 0 for the other losses."""
    distill = config.algorithm.distill
    if distill.loss == "reverse_kl":
        return 0
    rows = config.data.batch_size * config.rollout.n
    share = -(-rows * layout.role("actor").ranks_per_chunk // config.placement.processes)
    per_token = top_k_bytes_per_token(distill.top_k, vocab_size, to_dtype(distill.top_k_dtype))
    return share * config.rollout.max_new_tokens * per_token


def pool_process_bytes(config: TrainerConfig, layout: RunLayout) -> dict[str, int]:
    """One standalone rollout process's parts: the runtime, the engine's weights and what it
    holds beyond them, and the staged copy of the weights a delta or streaming pool keeps
    (:mod:`hf_core.sync.receiver`)."""
    spec = _spec(config, config.actor, "actor.model_path")
    weights = _bytes(config.rollout.engine, "dtype") * spec.num_params
    staged = config.rollout.sync == "delta" or config.rollout.mode == "streaming"
    return {
        "runtime": RUNTIME_BYTES,
        "weights": weights,
        "engine overhead": rollout_overhead_bytes(config, layout.generation),
        "staged weights": weights if staged else 0,
    }


def _pool_shortfall(config: TrainerConfig, layout: RunLayout, node_bytes: int | None) -> str:
    """Why a rollout process of a standalone pool cannot fit ("" when it can): its parts
    against an equal share of the node among every process of the run on it."""
    placement = config.placement
    if placement.mode != "standalone":
        return ""
    per_node = max(1, (placement.processes + placement.rollout_processes) // placement.nodes)
    budget = process_budget_bytes(per_node, node_bytes)
    parts = pool_process_bytes(config, layout)
    if sum(parts.values()) <= budget:
        return ""
    listed = ", ".join(f"{name} {size_text(size)}" for name, size in parts.items() if size)
    return (
        f"a rollout process needs about {size_text(sum(parts.values()))} ({listed}) against "
        f"a budget of {size_text(budget)} per process ({per_node} processes share the node)"
    )


def _runs_on_gpus(config: TrainerConfig) -> bool:
    """Whether the workers will get GPUs (``cluster.use_gpu``; ``auto``: this node has one)."""
    if config.cluster.use_gpu == "auto":
        import torch

        return torch.cuda.is_available()
    return bool(config.cluster.use_gpu)


def check_memory_fit(
    config: TrainerConfig, layout: RunLayout, node_bytes: int | None = None
) -> None:
    """Raise :class:`MemoryFitError` when the actor's process cannot fit (local CPU runs);
    ``layout``: the run's resolved layout."""
    if config.cluster.address or os.environ.get("RAY_ADDRESS") or _runs_on_gpus(config):
        return
    if config.placement.mode == "auto" or config.placement.nodes != 1:
        return
    fit, rollout_growth = _actor_process(config, layout, node_bytes)
    # while generating: no update, but the rollout engine whole (its KV cache back)
    generating = fit.parts["state"] + fit.parts["resident"] + rollout_growth
    shortfall = ""
    if fit.total_bytes > fit.budget_bytes:
        shortfall = f"while training, {fit.describe()}"
    elif generating > fit.budget_bytes:
        shortfall = (
            f"while generating, estimated peak {size_text(generating)} (the training state, "
            f"the resident parts and {size_text(rollout_growth)} the rollout engine hands back "
            "during training) "
            f"against a budget of {size_text(fit.budget_bytes)} per process"
        )
    pool = _pool_shortfall(config, layout, node_bytes)
    if pool:
        raise MemoryFitError(
            f"the rollout pool's processes cannot fit this machine: {pool}.  Use bfloat16 "
            "rollout weights (rollout.engine.dtype), rollout.sync: full with rollout.mode: "
            "batch (no staged copy), fewer rollout processes, or a machine with more memory"
        )
    if shortfall:
        raise MemoryFitError(
            f"the actor's processes cannot fit this machine: {shortfall} "
            f"({config.placement.processes} processes share it).  Use bfloat16 weights "
            "(actor.engine.param_dtype, rollout.engine.dtype), LoRA (actor.engine.lora), "
            "fewer colocated roles, actor.parallel.sp for long responses, or a machine with "
            "more memory"
        )
