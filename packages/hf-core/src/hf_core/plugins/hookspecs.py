"""The hooks a HybridFlow plugin implements: the one way to extend HybridFlow.

A plugin (a backend, or any package adding an estimator, a loss, a KL estimator, an
aggregation mode, a reward, a tool or an environment) is a distribution with an entry point
in the ``hybridflow.plugins`` group whose value is a module (or object) carrying
``@hookimpl`` functions.  Each hook receives a ``register`` callable; calling it adds one
thing to the registry, so a plugin declares what it provides without import-time side
effects.  The group was named ``hybridflow.backends`` before it carried more than backends:
that name is still read, with a DeprecationWarning, until :data:`DEPRECATED_GROUP_REMOVED_IN`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "hybridflow"
ENTRY_POINT_GROUP = "hybridflow.plugins"
DEPRECATED_ENTRY_POINT_GROUP = "hybridflow.backends"
"""The group's old name: its entry points still load, each with a DeprecationWarning."""
DEPRECATED_GROUP_REMOVED_IN = "0.3"
"""The release that stops reading :data:`DEPRECATED_ENTRY_POINT_GROUP`."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_training_engines(register: Callable[..., None]) -> None:
    """Register training engines: ``register(name, factory, config=Settings, parallel=())``.

    ``factory(**config)`` must return an object implementing
    :class:`hf_core.engines.TrainingEngine`.  ``config`` (optional, recommended) is the
    pydantic model of the engine's settings: a recipe's ``engine:`` block is validated against
    it when the recipe loads, before any process starts.  ``parallel`` names the model-parallel
    axes the engine supports (``("tp", "pp")``; empty: data parallel only); its settings then
    hold ``tensor_parallel_size`` / ``pipeline_parallel_size``, which core fills from the
    role's ``parallel: {tp, pp}`` (:mod:`hf_core.config.layout`).
    """


@hookspec
def register_rollout_engines(register: Callable[..., None]) -> None:
    """Register rollout engines: ``register(name, factory, config=SettingsModel)``.

    ``factory(**config)`` must return an object implementing
    :class:`hf_core.engines.RolloutEngine`; ``config`` as for training engines.  ``parallel``
    of ``("tp",)`` says the engine forms one replica over ``tensor_parallel_size`` consecutive
    ranks and loads generation TP slices (:class:`hf_core.engines.LoadsTPSlices`); its
    settings then take ``tensor_parallel_size``, which core fills from the run's resolved
    ``rollout.tensor_parallel_size``.
    """


@hookspec
def register_protocols(register: Callable[[Any], None]) -> None:
    """Register transfer protocols: ``register(protocol)``.

    ``protocol`` is a :class:`hf_core.protocols.TransferProtocol`; its name becomes usable in
    ``@register(protocol=...)`` on worker methods.
    """


@hookspec
def register_tools(register: Callable[..., None]) -> None:
    """Register agent tools: ``register(name, fn, description="", parameters=None)``.

    ``fn(**arguments)`` is a plain or ``async`` function returning the tool's result (a
    string, or anything ``str()`` turns into one); raising :class:`hf_core.agents.tools.ToolError`
    reports a failure to the model.  ``parameters`` is the JSON schema of its arguments, shown
    to the model through the chat template's ``tools``.  A recipe enables tools by name in
    ``agent.tools`` (or names ``module:function`` directly).
    """


@hookspec
def register_advantage_estimators(register: Callable[..., None]) -> None:
    """Register advantage estimators: ``register(name, fn, needs_critic=False,
    needs_groups=False, needs_greedy_baseline=False)``.

    ``fn(token_level_rewards, response_mask, **inputs) -> (advantages, returns)`` as the
    built-ins (:mod:`hf_core.algorithms.advantages`); the traits say what the dataflow must
    provide (a critic's values, groups of ``rollout.n >= 2`` samples, a greedy baseline).  A
    recipe uses it as ``algorithm.advantage: <name>``.
    """


@hookspec
def register_policy_losses(register: Callable[..., None]) -> None:
    """Register policy losses: ``register(name, fn)``.

    ``fn(log_prob, old_log_prob, advantages, response_mask, config=None, **group) -> (loss,
    metrics)`` as the built-ins (:mod:`hf_core.algorithms.losses`).  A recipe uses it as
    ``algorithm.policy_loss: <name>``; it runs in the actor's workers, which load the same
    plugins.
    """


@hookspec
def register_kl_estimators(register: Callable[..., None]) -> None:
    """Register per-token KL estimators: ``register(name, fn)``.

    ``fn(log_prob, ref_log_prob) -> tensor`` of the inputs' shape, as the built-ins ``k1``,
    ``k2``, ``k3``, ``abs`` (:mod:`hf_core.algorithms.kl`).  A recipe uses it as
    ``algorithm.kl.estimator: <name>`` (or ``algorithm.distill.estimator``).
    """


@hookspec
def register_aggregation_modes(register: Callable[..., None]) -> None:
    """Register loss aggregation modes: ``register(name, fn)``.

    ``fn(loss_mat, mask, *, group_ids=None, norm_length=None) -> scalar`` reduces a per-token
    loss [B, T] under a mask whose values are token weights, as the built-ins
    (:mod:`hf_core.algorithms.aggregation`).  A recipe uses it as
    ``algorithm.loss_agg_mode: <name>``; a mode core does not know is split over micro-batches
    and ranks as a mean over the mini-batch's rows.
    """


@hookspec
def register_environments(register: Callable[..., None]) -> None:
    """Register agent environments: ``register(name, factory)``.

    ``factory()`` (a class, usually) makes one environment per sample with ``reset(prompt)``
    and ``step(turn_text) -> str | None`` (:class:`hf_core.agents.environment.Environment`).
    A recipe uses it as ``agent.environment: <name>`` (or names ``module:Class`` directly).
    """


@hookspec
def register_env_kinds(register: Callable[..., None]) -> None:
    """Register task environment kinds: ``register(name, cls)``.

    ``cls`` has a pydantic ``Settings`` model (the recipe's ``env`` keys besides ``kind``),
    ``records(split)`` and ``score(responses, ground_truths, extras)``
    (:class:`hf_core.environments.TaskEnvironment`).  A recipe uses it as
    ``env: {kind: <name>, ...}``.
    """


@hookspec
def register_reward_functions(register: Callable[..., None]) -> None:
    """Register rule-based reward functions: ``register(name, fn, batched=True)``.

    ``fn(responses, ground_truths, extras) -> list[float]`` (``batched=False``:
    ``fn(response, ground_truth, extra) -> float``), as :mod:`hf_core.rewards.registry`
    describes.  A recipe uses it as ``reward.function: <name>``.
    """
