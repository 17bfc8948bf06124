"""Pieces every role worker shares: building engines by name, the PPO epoch/mini-batch loop.

The engine arguments are also what the pre-start checks validate a recipe's ``engine:``
blocks against, before torch is imported: torch, the engines and the agent loop are imported
where they are used.  The layout in them is the run's :class:`~hf_core.config.layout.RunLayout`
as the driver resolved it (a worker receives it with its config): nothing here reads the
recipe's parallel keys again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hf_core.config import ModelRoleConfig, TrainerConfig
from hf_core.config.layout import ENGINE_LAYOUT_SETTINGS, TrainingLayout
from hf_core.plugins import get_engine_parallelism, get_training_engine

if TYPE_CHECKING:
    from hf_core.agents.function_agents import FunctionAgentLoop
    from hf_core.agents.loop import AgentLoop
    from hf_core.batch import Batch
    from hf_core.engines import LossFn, RolloutEngine, TrainingEngine
    from hf_core.protocols import WorkerMesh
    from hf_core.resharding import GenerationLayout


def build_agent_loop(
    config: TrainerConfig,
    generation: GenerationLayout,
    engine: RolloutEngine,
    version: Callable[[], int] = lambda: 0,
) -> AgentLoop | FunctionAgentLoop | None:
    """The agent loop the recipe's ``agent:`` section asks for around ``engine``, with the
    run's tokenizer and its tools resolved by name (or, with ``agent.function``, the user's
    agent function against the policy endpoint; ``version``: the policy version the engine
    holds; ``generation``: the run's generation layout, which the engine was built with);
    None without that section.  Sets this process's sandbox to the recipe's
    ``sandbox:`` section (the ``python`` tool runs there)."""
    if config.agent is None:
        return None
    from transformers import AutoTokenizer

    from hf_core.agents.loop import AgentLoop
    from hf_core.agents.sandbox_choice import use_sandbox
    from hf_core.plugins.tools import resolve_tools

    use_sandbox(config.sandbox)

    tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer_path), local_files_only=True)
    if config.runs_agent_function:  # needs the 'serve' extra (FastAPI, openai)
        from hf_core.agents.function_agents import FunctionAgentLoop, load_agent_function
        from hf_core.roles.sequence_capacity import sequence_bounds  # it imports this module

        capacity = sequence_bounds(
            config, generation
        ).capacity  # longer prompts are refused, not batched
        if config.agent.function is not None:
            function = load_agent_function(config.agent.function)
        else:  # an environment that runs its own episodes (built again in this process)
            function = _episode_function(config)
        return FunctionAgentLoop(engine, tokenizer, config.agent, function, version, capacity)
    return AgentLoop(engine, tokenizer, config.agent, resolve_tools(config.agent.tools))


def _episode_function(config: TrainerConfig) -> Callable[[Any, dict[str, Any]], Any]:
    """``env.run`` with the recipe's agent limits bound: what runs each sample's episode."""
    import functools

    from hf_core.environments import build_environment, runs_rollouts

    assert config.env is not None and config.agent is not None
    environment = build_environment(config.env.model_dump())
    if not runs_rollouts(environment):
        raise TypeError(f"env.kind {config.env.kind} does not run episodes")
    run = environment.run  # type: ignore[attr-defined]
    return functools.partial(run, agent=config.agent)


def build_training_engine(
    role: ModelRoleConfig,
    config: TrainerConfig,
    layout: TrainingLayout,
    *,
    head: str,
    trainable: bool,
) -> TrainingEngine:
    """Create the role's engine through the plugin registry.

    Every training engine factory takes ``model_path``, ``head``, ``trainable`` and ``seed``;
    ``layout`` (the role's part of the run's resolved layout) adds the sizes of the axes the
    engine declares; the role's ``engine:`` block adds backend-specific settings.
    """
    factory = get_training_engine(role.backend)
    core = training_engine_args(config, role, layout, head=head, trainable=trainable)
    return factory(**{**core, **role.engine})


def training_engine_args(
    config: TrainerConfig,
    role: ModelRoleConfig,
    layout: TrainingLayout,
    *,
    head: str,
    trainable: bool,
) -> dict[str, Any]:
    """The keys core passes to every training engine factory (``layout``: the role's
    training layout, from the run's resolved layout); the role's ``engine:`` block is added
    on top (it may override ``seed``, nothing else core sets)."""
    args: dict[str, Any] = {
        "model_path": str(config.role_model(role)),
        "head": head,
        "trainable": trainable,
        "seed": config.run.seed,
    }
    sizes = (layout.tp, layout.pp, layout.sp, layout.ep)
    return {**args, **_layout_args("training", role.backend, *sizes)}


def rollout_engine_args(config: TrainerConfig, layout: GenerationLayout) -> dict[str, Any]:
    """The keys core passes to the rollout engine factory: the model, and the run's resolved
    generation layout ``layout`` for engines that declare those axes; the ``rollout.engine``
    block adds backend settings on top."""
    args: dict[str, Any] = {"model_path": str(config.role_model(config.actor))}
    return {**args, **_layout_args("rollout", config.rollout.backend, layout.tp, layout.pp)}


def _layout_args(
    kind: Literal["training", "rollout"], backend: str, tp: int, pp: int, sp: int = 1, ep: int = 1
) -> dict[str, int]:
    """``tensor_parallel_size`` / ``pipeline_parallel_size`` / ``sequence_parallel_size`` for
    the axes the engine declares (an engine without them is data parallel: it takes none)."""
    axes = get_engine_parallelism(kind, backend)
    sizes = {"tp": tp, "pp": pp, "sp": sp, "ep": ep}
    return {ENGINE_LAYOUT_SETTINGS[axis]: sizes[axis] for axis in sorted(axes) if axis in sizes}


def mini_batch_updates(
    engine: TrainingEngine,
    batch: Batch,
    loss_fn: LossFn,
    *,
    epochs: int,
    mini_batches: int,
    seed: int,
) -> dict[str, float]:
    """``epochs`` passes over this rank's batch, ``mini_batches`` optimizer steps each.

    The order inside an epoch is a seeded permutation (same on every run, so resumed runs
    repeat it); metrics are combined over all optimizer steps (means; maxima for ``*_max``).
    """
    import torch

    from hf_core.engines.metric_rows import combine_metric_rows

    rows: list[dict[str, float]] = []
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed(seed * 1000 + epoch)
        order = torch.randperm(len(batch), generator=generator)
        for part in batch.index(order).chunk(mini_batches):
            rows.append(engine.train_step(part, loss_fn))
    return combine_metric_rows(rows)


def training_mesh(engine: TrainingEngine, default: WorkerMesh) -> WorkerMesh:
    """The engine's own TP/PP/DP coordinates if it has model parallelism, else ``default``."""
    from hf_core.engines.capabilities import HasWorkerMesh

    return engine.worker_mesh() if isinstance(engine, HasWorkerMesh) else default


def torch_threads(config: TrainerConfig) -> int:
    """``run.torch_threads``, or the node's cores shared evenly by the run's processes.

    More threads than cores makes OpenMP workers spin against each other (several-fold
    slower on a small CPU box); one rank's share of the cores is the useful maximum.
    """
    if config.run.torch_threads is not None:
        return config.run.torch_threads
    placement = config.placement
    processes = placement.processes
    if placement.mode == "split":
        processes += placement.other_processes
    if placement.mode == "standalone":
        processes += placement.rollout_processes
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // processes)


def role_path(path: str | Path, role: str) -> Path:
    return Path(path) / role
