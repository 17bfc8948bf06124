"""Checks a run's configuration against what is installed, before any process starts.

The recipe schema (:mod:`hf_core.config`) types every field; what it cannot know -- which
algorithms, engines and engine settings exist -- lives in registries that the algorithms and
the installed backend plugins fill.  This module checks those names and ``engine:`` blocks so
a typo exits with a :class:`~hf_core.config.ConfigError` naming the key, not a traceback from
a worker after Ray has started.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from hf_core.algorithms import (
    get_aggregation_mode,
    get_estimator_traits,
    get_policy_loss,
)
from hf_core.config import ConfigError, ModelRoleConfig, TrainerConfig, load_config, validate
from hf_core.errors import EngineConfigError
from hf_core.plugins import UnknownNameError, get_engine_config
from hf_core.roles.common import training_engine_args

EngineKind = Literal["training", "rollout"]


def load_run_config(recipe: str | Path | None, overrides: Sequence[str] = ()) -> TrainerConfig:
    """Read a recipe with overrides, validate its schema, then :func:`preflight` it."""
    config = load_config(TrainerConfig, recipe, overrides)
    preflight(config)
    return config


def preflight(config: TrainerConfig) -> None:
    """Raise :class:`ConfigError` naming the key if a name or an ``engine:`` block is wrong."""
    _check_algorithm(config)
    for key, kind, backend, block, supplied in _engine_blocks(config):
        _check_engine_block(key, kind, backend, block, supplied)


def _check_algorithm(config: TrainerConfig) -> None:
    algo = config.algorithm
    for key, name, lookup in (
        ("algorithm.advantage", algo.advantage, get_estimator_traits),
        ("algorithm.cost_advantage", algo.cost_advantage, get_estimator_traits),
        ("algorithm.policy_loss", algo.policy_loss, get_policy_loss),
        ("algorithm.loss_agg_mode", algo.loss_agg_mode, get_aggregation_mode),
    ):
        try:
            lookup(name)
        except UnknownNameError as exc:
            raise ConfigError(f"invalid configuration:\n  {key}: {exc}") from None
    traits = get_estimator_traits(algo.advantage)
    if traits.needs_critic and config.critic is None:
        raise ConfigError(f"algorithm.advantage={algo.advantage} needs a 'critic' section")
    if traits.needs_groups and config.rollout.n < 2:
        raise ConfigError(
            f"algorithm.advantage={algo.advantage} compares samples of one prompt: "
            f"rollout.n must be >= 2 (got {config.rollout.n})"
        )
    if config.cost is not None and get_estimator_traits(algo.cost_advantage).needs_critic:
        raise ConfigError(
            f"algorithm.cost_advantage={algo.cost_advantage} needs a critic; there is no cost "
            "critic: choose an estimator without one (e.g. reinforce_plus_plus)"
        )


def _engine_blocks(
    config: TrainerConfig,
) -> Iterator[tuple[str, EngineKind, str, dict[str, Any], dict[str, Any]]]:
    """(YAML key, kind, backend, the ``engine:`` block, what the role worker adds) per engine."""
    training: list[tuple[str, ModelRoleConfig | None, str, bool]] = [
        ("actor", config.actor, "lm", True),
        ("reference", config.reference, "lm", False),
        ("critic", config.critic, "value", True),
        ("reward.model", config.reward.model, "score", False),
        ("cost.model", config.cost.model if config.cost is not None else None, "score", False),
    ]
    for key, role, head, trainable in training:
        if role is not None:
            supplied = training_engine_args(config, role, head=head, trainable=trainable)
            yield key, "training", role.backend, role.engine, supplied
    supplied = {"model_path": str(config.role_model(config.actor))}
    yield "rollout", "rollout", config.rollout.backend, config.rollout.engine, supplied


def _check_engine_block(
    key: str, kind: EngineKind, backend: str, block: dict[str, Any], supplied: dict[str, Any]
) -> None:
    try:
        model = get_engine_config(kind, backend)
    except UnknownNameError as exc:
        raise ConfigError(f"invalid configuration:\n  {key}.backend: {exc}") from None
    if model is None:
        return  # the plugin registered no settings model: the engine checks its own
    clash = sorted(set(block) & (set(supplied) - {"seed"}))
    if clash:
        raise ConfigError(
            f"invalid configuration:\n  {key}.engine.{clash[0]}: set by the trainer for every "
            f"{kind} engine; remove it from the engine block"
        )
    data = {**supplied, **block}  # exactly what the role worker will pass
    try:
        validate(model, data, f"{key}.engine ({backend})", EngineConfigError)
    except EngineConfigError as exc:
        text = str(exc)
        for field in model.model_fields:
            text = text.replace(f"\n  {field}:", f"\n  {key}.engine.{field}:")
        for bad in set(block) - set(model.model_fields):
            text = text.replace(f"\n  {bad}:", f"\n  {key}.engine.{bad}:")
        raise EngineConfigError(text) from None
