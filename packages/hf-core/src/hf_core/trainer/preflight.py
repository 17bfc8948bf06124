"""Checks a run's configuration against what is installed, before any process starts.

The recipe schema (:mod:`hf_core.config`) types every field; what it cannot know -- which
algorithms, engines, engine settings and reward functions exist -- lives in registries that
the algorithms and the installed backend plugins fill.  :func:`preflight` checks those names
and ``engine:`` blocks so a typo exits with a :class:`~hf_core.config.ConfigError` naming the
key, not a traceback from a worker after Ray has started.  It is also where a recipe's
parallel layout is resolved (:func:`hf_core.config.layout.resolve_layout`), once: it returns
the :class:`~hf_core.config.layout.RunLayout`, which every later step takes as an argument.

:func:`check_inputs` checks what the run reads from disk: every role's model folder
(``config.json``, safetensors weights), the tokenizer, the prompt files and, for ``--resume``,
the checkpoint, and that the actor's processes fit this machine's memory
(:mod:`hf_core.trainer.memory_check`).  Each failure is a
:class:`~hf_core.errors.HybridFlowError` naming the recipe key and the file, or the estimate
and the budget.  Neither writes anything, so a bad run leaves its output folder untouched.

Everything up to the tokenizer runs without importing torch, tensordict or Ray, so a bad
recipe is reported in about a second; loading the tokenizer imports torch (transformers), and
what needs it is imported from there on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from hf_core.algorithms import (
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    get_estimator_traits,
)
from hf_core.config import ConfigError, ModelRoleConfig, TrainerConfig, load_config, validate
from hf_core.config.layout import (
    ENGINE_LAYOUT_SETTINGS,
    MODEL_AXES,
    RunLayout,
    model_roles,
    resolve_layout,
)
from hf_core.data.io import check_dataset_file
from hf_core.engines.capabilities import DeclaresRoutedExperts
from hf_core.engines.hf_folder import check_model_folder, check_tokenizer, read_model_config
from hf_core.errors import CheckpointError, EngineConfigError, ModelFolderError
from hf_core.model_shapes import from_hf_config
from hf_core.plugins import UnknownNameError, get_engine_config, get_engine_parallelism
from hf_core.rewards import UnknownRewardFunctionError, get_reward_function
from hf_core.roles.common import rollout_engine_args, training_engine_args
from hf_core.roles.loss_advice import loss_agg_mode_advice

log = logging.getLogger(__name__)

EngineKind = Literal["training", "rollout"]


def load_run_config(
    recipe: str | Path | None, overrides: Sequence[str] = (), *, resume: bool = False
) -> tuple[TrainerConfig, RunLayout]:
    """Read a recipe with overrides, validate its schema, :func:`preflight` it and
    :func:`check_inputs` (``resume``: the run continues from its latest checkpoint): the
    config and its layout, resolved here once for the whole run (hand both to
    :class:`~hf_core.trainer.RLTrainer`)."""
    config = load_config(TrainerConfig, recipe, overrides)
    layout = preflight(config)
    check_inputs(config, layout, resume=resume)
    return config, layout


def preflight(config: TrainerConfig, layout: RunLayout | None = None) -> RunLayout:
    """Raise :class:`ConfigError` naming the key if a name or an ``engine:`` block is wrong;
    return the run's layout.

    ``layout``: the recipe's layout when the caller has it already (the planner's, for the
    recipe it applied); ``None``: resolved here -- the one place a recipe's layout is
    resolved, so pass the result on rather than resolving it again.
    """
    if config.trainer == "rl":  # the others sample nothing and compute no reward
        _check_algorithm(config)
        _check_reward_functions(config)
        _check_agent(config)
        _check_env(config)
    if layout is None:
        try:
            layout = resolve_layout(config)
        except ValueError as exc:
            raise ConfigError(f"invalid configuration:\n  rollout: {exc}") from None
    rollout_settings = None
    for key, kind, backend, block, supplied in _engine_blocks(config, layout):
        settings = _check_engine_block(key, kind, backend, block, supplied)
        if kind == "rollout":
            rollout_settings = settings
    _check_training_layouts(config, layout)  # every backend name is known by now
    _check_generation_layout(config, layout)
    _check_router_replay(config, rollout_settings)
    return layout


def check_inputs(config: TrainerConfig, layout: RunLayout, *, resume: bool = False) -> None:
    """Check every file the run reads before it starts: a :class:`HybridFlowError` naming the
    recipe key and the file otherwise (``layout``: what :func:`preflight` returned).

    Cheap checks first (existence, sizes, JSON), the tokenizer load last.  Reads only: a
    run that fails here has not created its output folder.
    """
    for key, folder in _model_folders(config):
        _check_model(key, folder)
    if config.reward.judge is not None:
        _check_model("reward.judge.model_path", config.reward.judge.model_path)
    _check_data_files(config)
    _check_teacher_vocabulary(config)
    if resume:
        _check_resume(config)
    tokenizer_key = "model.tokenizer_path" if config.model.tokenizer_path else "model.path"
    check_tokenizer(config.tokenizer_path, key=tokenizer_key)
    from hf_core.trainer.memory_check import check_memory_fit  # torch, as the tokenizer
    from hf_core.trainer.sequence_length import check_sequence_length

    check_sequence_length(config, layout)
    check_memory_fit(config, layout)


def _model_folders(config: TrainerConfig) -> Iterator[tuple[str, Path]]:
    """(recipe key the path comes from, folder) for every model role, each folder once."""
    seen: set[Path] = set()
    for key, role in model_roles(config).items():
        folder = config.role_model(role)
        if folder not in seen:
            seen.add(folder)
            yield (f"{key}.model_path" if role.model_path else "model.path"), folder


def _check_model(key: str, folder: Path) -> None:
    """The folder exists, its ``config.json`` is a HF config and its weights are present."""
    check_model_folder(folder, key=key, weights=True)
    if "model_type" not in read_model_config(folder, key=key):
        raise ModelFolderError(
            f"{key}: {folder / 'config.json'} has no 'model_type', so transformers cannot tell "
            "which model it describes; save the folder with model.save_pretrained(...)"
        )


def _check_teacher_vocabulary(config: TrainerConfig) -> None:
    """A top-k loss compares the teacher's and the student's probabilities of the same ids:
    both models must share a vocabulary, and ``top_k`` must not exceed it."""
    distill = config.algorithm.distill
    if config.teacher is None or distill.loss == "reverse_kl":
        return
    sizes = {
        key: from_hf_config(read_model_config(config.role_model(role), key=key)).vocab_size
        for key, role in (
            ("actor.model_path", config.actor),
            ("teacher.model_path", config.teacher),
        )
    }
    if len(set(sizes.values())) > 1:
        raise ConfigError(
            f"algorithm.distill.loss={distill.loss} compares the teacher's and the student's "
            f"probabilities of the same token ids, but their vocabularies differ ("
            + ", ".join(f"{key}: {size}" for key, size in sizes.items())
            + "); distill between models sharing a tokenizer, or use loss: reverse_kl"
        )
    vocab = next(iter(sizes.values()))
    if distill.top_k > vocab:
        raise ConfigError(
            f"algorithm.distill.top_k={distill.top_k} exceeds the vocabulary ({vocab} tokens)"
        )


def _check_data_files(config: TrainerConfig) -> None:
    data = config.data
    if config.env is not None:
        return  # the environment gives the prompts (checked by preflight)
    if not data.train_files:
        raise ConfigError(
            "invalid configuration:\n  data.train_files: empty; give at least one JSONL, "
            "JSON or Parquet file of prompts"
        )
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for i, path in enumerate(files):
            check_dataset_file(path, key=f"{key}[{i}]")


def _check_resume(config: TrainerConfig) -> None:
    """``--resume`` needs a complete checkpoint in ``run.output_dir``."""
    from hf_core.trainer.checkpoint import latest_checkpoint  # its module imports torch

    out = config.run.output_dir
    fresh = "run without --resume to start a new run"
    if not out.is_dir():
        raise CheckpointError(
            f"--resume: the output folder {out} (run.output_dir) does not exist, so there is "
            f"no checkpoint to resume from; {fresh}, or set run.output_dir to the earlier run's"
        )
    try:
        latest_checkpoint(out)
    except CheckpointError as exc:
        raise CheckpointError(f"--resume: {exc}; {fresh}") from None


def _check_reward_functions(config: TrainerConfig) -> None:
    """Resolve ``reward.function`` / ``cost.function`` now (a registered name, or a
    ``module:function`` imported here), not at the first scoring after Ray started."""
    for key, section in (("reward.function", config.reward), ("cost.function", config.cost)):
        if section is None or not section.function:
            continue
        try:
            get_reward_function(section.function)
        except UnknownRewardFunctionError as exc:
            raise ConfigError(f"invalid configuration:\n  {key}: {exc}") from None


def _check_env(config: TrainerConfig) -> None:
    """Build ``env`` now: a missing library, an unknown task or bad settings exit before Ray
    starts, naming the key (the trainer builds it again where it runs)."""
    if config.env is not None:
        from hf_core.environments import build_environment

        build_environment(config.env.model_dump())


def _check_agent(config: TrainerConfig) -> None:
    """Resolve ``agent.tools`` and ``agent.environment`` on the driver, before any worker
    process starts (the workers resolve them again where they run)."""
    if config.agent is None:
        return
    from hf_core.agents.loop import load_environment
    from hf_core.plugins.tools import resolve_tools

    try:
        resolve_tools(config.agent.tools)
        if config.agent.environment:
            load_environment(config.agent.environment)
    except ConfigError as exc:
        raise ConfigError(f"invalid configuration:\n  agent: {exc}") from None


def _check_training_layouts(config: TrainerConfig, layout: RunLayout) -> None:
    """A role may split its model (``parallel.tp`` / ``parallel.pp`` above 1) or its
    sequences (``parallel.sp``) only over the axes its training engine declares."""
    roles = model_roles(config)
    for key, sizes in layout.training:
        backend = roles[key].backend
        axes = get_engine_parallelism("training", backend)
        for axis, size in (("tp", sizes.tp), ("pp", sizes.pp), ("sp", sizes.sp), ("ep", sizes.ep)):
            if size > 1 and axis not in axes:
                raise ConfigError(
                    f"invalid configuration:\n  {key}.parallel.{axis}: {size}, but the "
                    f"{backend!r} training engine cannot split a {_SPLITS[axis]} over ranks "
                    f"({axis}); use 1, or a backend declaring {axis}"
                )
    _check_sequence_parallel(config, layout)


_SPLITS = {"tp": "model", "pp": "model", "sp": "sequence", "ep": "model's experts"}
SEQUENCE_PARALLEL_WITH_ACTOR = ("reference", "teacher")
"""Roles whose engines run in the actor's workers: they receive the actor's data chunks, so
they split sequences exactly as the actor does."""


def _check_sequence_parallel(config: TrainerConfig, layout: RunLayout) -> None:
    """``parallel.sp``: the ranks of a sequence-parallel group share one data chunk, so the
    size must divide the role's pool, engines sharing the actor's workers must split as the
    actor does, and the reward and cost models (plain data-parallel workers) cannot split."""
    sizes = dict(layout.training)
    actor_sp = sizes["actor"].sp
    for key in SEQUENCE_PARALLEL_WITH_ACTOR:
        if key in sizes and sizes[key].sp != actor_sp:
            raise ConfigError(
                f"invalid configuration:\n  {key}.parallel.sp: {sizes[key].sp}, but the "
                f"{key} runs in the actor's workers and gets the actor's data chunks; use "
                f"the actor's parallel.sp ({actor_sp})"
            )
    for key in ("reward.model", "cost.model"):
        if key in sizes and sizes[key].sp > 1:
            raise ConfigError(
                f"invalid configuration:\n  {key}.parallel.sp: {sizes[key].sp}; a reward or "
                "cost model scores whole sequences on each rank: use 1 (sequence parallelism "
                "is for the actor, reference and critic)"
            )
    placement = config.placement
    if placement.mode == "auto":
        return
    for key in ("actor", "critic"):
        if key not in sizes or sizes[key].sp == 1:
            continue
        split_critic = key == "critic" and placement.mode == "split"
        pool = placement.other_processes if split_critic else placement.processes
        if pool % sizes[key].ranks_per_chunk:
            raise ConfigError(
                f"invalid configuration:\n  {key}.parallel.sp: {sizes[key].sp} ranks split "
                f"each sequence; it must divide the {key}'s pool of {pool} processes"
            )


def _check_generation_layout(config: TrainerConfig, layout: RunLayout) -> None:
    """The rollout's generation layout ``(p_g, t_g)`` must be one the rollout engine can form
    and the 3D-HybridEngine can reshard into from the actor's layout (HybridFlow §5.4)."""
    rollout, gen = config.rollout, layout.generation
    if gen.tp == 1 and gen.pp == 1:
        return
    axes = get_engine_parallelism("rollout", rollout.backend)
    for key, size, axis in (
        ("tensor_parallel_size", gen.tp, "tp"),
        ("pipeline_parallel_size", gen.pp, "pp"),
    ):
        if size > 1 and axis not in axes:
            raise ConfigError(
                f"invalid configuration:\n  rollout.{key}: {size}, but the "
                f"{rollout.backend!r} rollout engine cannot split a model over ranks "
                f"({axis}); use 1, or a rollout backend that loads {axis.upper()} slices"
            )
    if config.placement.mode != "auto" and config.placement.processes % (gen.tp * gen.pp):
        raise ConfigError(
            f"invalid configuration:\n  rollout.tensor_parallel_size: t_g * p_g = "
            f"{gen.tp * gen.pp} ranks form one rollout engine; it must divide the actor's "
            f"placement.processes = {config.placement.processes}"
        )
    if not get_engine_parallelism("training", config.actor.backend) & MODEL_AXES:
        return  # a data-parallel actor streams whole tensors: any engine shards them itself
    train = layout.role("actor")
    for key, size, actor_size, name, axis in (
        ("tensor_parallel_size", gen.tp, train.tp, "t", "tp"),
        ("pipeline_parallel_size", gen.pp, train.pp, "p", "pp"),
    ):
        if actor_size % size:
            raise ConfigError(
                f"invalid configuration:\n  rollout.{key}: {size} does not divide the "
                f"actor's parallel.{axis} {actor_size}; the 3D-HybridEngine regroups training "
                f"ranks into generation groups, so {name}_g must divide {name} (HybridFlow §5.4)"
            )


def _check_router_replay(config: TrainerConfig, rollout_settings: object) -> None:
    """Routing replay of a mixture-of-experts actor needs rollouts that carry the experts
    they were routed to: a rollout engine that returns them, and a rollout path that keeps
    them (docs/moe.md).  A run that would silently train without replay stops here."""
    if config.algorithm.router_replay != "rollout":
        return
    try:
        spec = from_hf_config(read_model_config(config.role_model(config.actor)))
    except (ModelFolderError, ValueError):
        return  # check_inputs names a missing or broken model folder
    if not spec.is_mixture_of_experts:
        return
    backend = config.rollout.backend
    if isinstance(rollout_settings, DeclaresRoutedExperts):
        reason = rollout_settings.routed_experts_unsupported()
    else:
        reason = f"the {backend!r} rollout engine does not return the experts it routes to"
    # streaming rollouts carry them: each request keeps the experts of its fed positions,
    # partial rollouts included (hf_core.engines.streaming.StreamRequest.record_routing)
    if reason is not None:
        raise ConfigError(
            f"invalid configuration:\n  algorithm.router_replay: rollout (the default for a "
            f"mixture-of-experts model), but {reason}; set algorithm.router_replay=off to let "
            "the trainer's router decide (docs/moe.md)"
        )


def _check_algorithm(config: TrainerConfig) -> None:
    """Every algorithm name is registered (checked by name: the built-ins' torch modules are
    not imported), and the dataflow has what the estimator needs."""
    algo = config.algorithm
    for key, name, lookup in (
        ("algorithm.advantage", algo.advantage, get_estimator_traits),
        ("algorithm.cost_advantage", algo.cost_advantage, get_estimator_traits),
        ("algorithm.policy_loss", algo.policy_loss, POLICY_LOSSES.require),
        ("algorithm.loss_agg_mode", algo.loss_agg_mode, AGGREGATION_MODES.require),
        ("algorithm.kl.estimator", algo.kl.estimator, KL_ESTIMATORS.require),
    ):
        try:
            lookup(name)
        except UnknownNameError as exc:
            raise ConfigError(f"invalid configuration:\n  {key}: {exc}") from None
    advice = loss_agg_mode_advice(algo)
    if advice is not None:
        log.warning(advice)
    traits = get_estimator_traits(algo.advantage)
    if traits.needs_critic and config.critic is None:
        raise ConfigError(f"algorithm.advantage={algo.advantage} needs a 'critic' section")
    if traits.needs_groups and config.rollout.n < 2:
        raise ConfigError(
            f"algorithm.advantage={algo.advantage} compares samples of one prompt: "
            f"rollout.n must be >= 2 (got {config.rollout.n})"
        )
    if config.teacher is not None:
        try:
            KL_ESTIMATORS.require(algo.distill.estimator)
        except UnknownNameError as exc:
            raise ConfigError(
                f"invalid configuration:\n  algorithm.distill.estimator: {exc}"
            ) from None
    if config.cost is not None and get_estimator_traits(algo.cost_advantage).needs_critic:
        raise ConfigError(
            f"algorithm.cost_advantage={algo.cost_advantage} needs a critic; there is no cost "
            "critic: choose an estimator without one (e.g. reinforce_plus_plus)"
        )


def _engine_blocks(
    config: TrainerConfig, layout: RunLayout
) -> Iterator[tuple[str, EngineKind, str, dict[str, Any], dict[str, Any]]]:
    """(YAML key, kind, backend, the ``engine:`` block, what the role worker adds) per engine."""
    training: list[tuple[str, ModelRoleConfig | None, str, bool]] = [
        ("actor", config.actor, "lm", True),
        ("reference", config.reference, "lm", False),
        ("teacher", config.teacher, "lm", False),
        ("critic", config.critic, "value", True),
        # trained only by its own trainer (a LoRA reward model is valid there, nowhere else)
        ("reward.model", config.reward.model, "score", config.trainer == "reward_model"),
        ("cost.model", config.cost.model if config.cost is not None else None, "score", False),
    ]
    for key, role, head, trainable in training:
        if role is not None:
            try:
                supplied = training_engine_args(
                    config, role, layout.role(key), head=head, trainable=trainable
                )
            except UnknownNameError as exc:
                raise ConfigError(f"invalid configuration:\n  {key}.backend: {exc}") from None
            yield key, "training", role.backend, role.engine, supplied
    try:
        supplied = rollout_engine_args(config, layout.generation)
    except UnknownNameError as exc:
        raise ConfigError(f"invalid configuration:\n  rollout.backend: {exc}") from None
    yield "rollout", "rollout", config.rollout.backend, config.rollout.engine, supplied


def _layout_key(key: str, kind: EngineKind, setting: str) -> str | None:
    """Where a recipe states the layout an engine setting carries (``use actor.parallel.tp``)."""
    axis = {name: axis for axis, name in ENGINE_LAYOUT_SETTINGS.items()}.get(setting)
    if axis is None:
        return None
    return f"use {key}.{setting}" if kind == "rollout" else f"use {key}.parallel.{axis}"


def _check_engine_block(
    key: str, kind: EngineKind, backend: str, block: dict[str, Any], supplied: dict[str, Any]
) -> Any:
    """The engine's validated settings (``None`` if its plugin registered no model)."""
    for setting in sorted(block):
        layout_key = _layout_key(key, kind, setting)
        if layout_key is not None:  # the layout has one spelling, whatever the backend
            raise ConfigError(
                f"invalid configuration:\n  {key}.engine.{setting}: the parallel layout is "
                f"not an engine setting; {layout_key}"
            )
    try:
        model = get_engine_config(kind, backend)
    except UnknownNameError as exc:
        raise ConfigError(f"invalid configuration:\n  {key}.backend: {exc}") from None
    if model is None:
        return None  # the plugin registered no settings model: the engine checks its own
    clash = sorted(set(block) & (set(supplied) - {"seed"}))
    if clash:
        raise ConfigError(
            f"invalid configuration:\n  {key}.engine.{clash[0]}: set by the trainer for every "
            f"{kind} engine; remove it from the engine block"
        )
    data = {**supplied, **block}  # exactly what the role worker will pass
    try:
        return validate(model, data, f"{key}.engine ({backend})", EngineConfigError)
    except EngineConfigError as exc:
        text = str(exc)
        for field in model.model_fields:
            text = text.replace(f"\n  {field}:", f"\n  {key}.engine.{field}:")
        for bad in set(block) - set(model.model_fields):
            text = text.replace(f"\n  {bad}:", f"\n  {key}.engine.{bad}:")
        raise EngineConfigError(text) from None
