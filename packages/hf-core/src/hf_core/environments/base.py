"""Task environments: the prompts of a run and the code that scores answers to them, from a
library users already have, named in a recipe as ``env: {kind: <name>, ...settings}``.

An environment kind is a class with a pydantic ``Settings`` model (the recipe's ``env`` keys
other than ``kind``), built as ``Kind(settings)`` where the recipe loads -- before Ray starts,
so a missing library or an unknown task is a :class:`~hf_core.errors.ConfigError` naming the
key -- and used by the trainer for:

* ``records(split)``: the ``train`` / ``val`` prompt records (``prompt``, ``ground_truth``,
  ``env_task`` -- the task a record belongs to, which per-task metrics group by -- and
  whatever else ``score`` needs, carried with each sample as extras);
* ``score(responses, ground_truths, extras)``: one reward a response, computed by the
  library's own code (a batched reward function, :mod:`hf_core.rewards.registry`);
* or, for a kind whose episodes are multi-turn and scored by the environment itself
  (verifiers, OpenEnv), ``run(client, sample, agent)`` instead of ``score``: one episode against the
  policy's OpenAI-compatible endpoint (:mod:`hf_core.agents.function_agents` runs it for every
  sample, as it runs an ``agent.function``), returning the episode's reward.  Such a kind is a
  :class:`RolloutEnvironment`; the recipe's ``agent:`` section (its defaults when absent) sets
  the turns, tokens and time an episode may use.

Kinds are registered in :data:`ENV_KINDS` (built-ins declared below, imported on first use;
plugins through the ``register_env_kinds`` hook) or named as ``package.module:Class``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ValidationError

from hf_core.errors import ConfigError
from hf_core.imports import resolve
from hf_core.registry import NamedRegistry, UnknownNameError

Split = Literal["train", "val"]
ENV_TASK_KEY = "env_task"
"""The record field naming a record's task (per-task metrics group by it)."""


class TaskEnvironment(Protocol):
    """What the trainer uses of an environment (see the module doc)."""

    Settings: ClassVar[type[BaseModel]]

    def records(self, split: Split) -> list[dict[str, Any]]: ...

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extras: Mapping[str, Sequence[Any]],
    ) -> list[float]: ...


class RolloutEnvironment(Protocol):
    """An environment that runs each sample's episode itself (see the module doc)."""

    Settings: ClassVar[type[BaseModel]]

    def records(self, split: Split) -> list[dict[str, Any]]: ...

    async def run(self, client: Any, sample: dict[str, Any], agent: Any) -> Any:
        """One episode: ``client`` an ``openai.AsyncOpenAI`` bound to the sample's trajectory,
        ``sample`` its record, ``agent`` the recipe's :class:`~hf_core.agents.config.
        AgentConfig` (the endpoint's ``model_name``, ``max_turns``); returns the reward (a
        number or an :class:`~hf_core.agents.function_agents.AgentResult`)."""
        ...


def runs_rollouts(kind: object) -> bool:
    """Whether an environment (class or instance) runs its own episodes (has ``run``)."""
    return callable(getattr(kind, "run", None))


def kind_runs_rollouts(kind: str) -> bool:
    """Whether the environment kind named ``kind`` runs its own episodes; False when the name
    does not resolve (the pre-start checks report that, naming the key)."""
    try:
        cls = resolve(kind, key="env.kind", table=ENV_KINDS, error=UnknownEnvKindError).value
    except Exception:  # reported where the environment is built
        return False
    return runs_rollouts(cls)


class UnknownEnvKindError(ConfigError, UnknownNameError):
    """A recipe's ``env.kind`` is neither registered nor an importable class."""


ENV_KINDS: NamedRegistry[type[Any]] = NamedRegistry(
    "environment kind",
    miss_error=UnknownEnvKindError,
    miss_hint="register it with the register_env_kinds plugin hook or give 'package.module:Class'",
)
ENV_KINDS.declare("hf_core.environments.reasoning_gym", "reasoning_gym")
ENV_KINDS.declare("hf_core.environments.openenv_env", "openenv")
ENV_KINDS.declare("hf_core.environments.verifiers_env", "verifiers")


def require_library(module: str, kind: str, extra: str) -> Any:
    """The module an environment kind's library provides, imported; a ConfigError naming
    the extra to install when it is missing (before Ray starts, as every env check is)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"env.kind: {kind} needs the {module.split('.')[0]} library: "
            f"pip install 'hf-core[{extra}]'"
        ) from None


def register_env_kind(name: str, cls: type[Any], *, owner: str = "") -> type[Any]:
    """Add an environment kind (what the ``register_env_kinds`` hook's ``register`` does);
    registering the same class again is a no-op."""
    if not isinstance(getattr(cls, "Settings", None), type):
        raise TypeError(f"environment kind {name!r}: {cls!r} has no pydantic Settings class")
    if ENV_KINDS.holds(name, cls):
        return cls
    return ENV_KINDS.add(name, cls, owner=owner)


def build_environment(block: Mapping[str, Any], key: str = "env") -> TaskEnvironment:
    """The environment a recipe's ``env`` block describes, its settings validated (every
    problem a :class:`ConfigError` naming ``env.<field>``)."""
    settings = dict(block)
    kind = settings.pop("kind", None)
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"{key}.kind: name the environment kind (e.g. reasoning_gym)")
    try:
        cls = resolve(
            kind,
            key=f"{key}.kind",
            table=ENV_KINDS,
            error=UnknownEnvKindError,
            accept=lambda value: isinstance(getattr(value, "Settings", None), type),
            expected="an environment class with a pydantic Settings model",
            form="'package.module:Class'",
        ).value
    except UnknownEnvKindError as exc:
        message = str(exc)
        if not message.startswith(f"{key}.kind"):
            message = f"{key}.kind: {message}"
        raise UnknownEnvKindError(f"invalid configuration:\n  {message}") from None
    try:
        parsed = cls.Settings.model_validate(settings)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join([key, *(str(p) for p in err['loc'])])}: {err['msg']}"
            for err in exc.errors()
        ]
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None
    environment: TaskEnvironment = cls(parsed)
    return environment


def task_metrics(
    tasks: Sequence[Any],
    scores: Sequence[float],
    prefix: str = "env",
    turns: Sequence[float] | None = None,
) -> dict[str, float]:
    """Per task of a batch: ``<prefix>/<task>/reward`` (mean score) and
    ``<prefix>/<task>/success`` (the share scoring 1.0 or more), plus ``<prefix>/<task>/count``
    and, for multi-turn episodes (``turns`` given), ``<prefix>/<task>/turns`` (mean)."""
    grouped: dict[str, list[tuple[float, float]]] = {}
    every_turn = [0.0] * len(scores) if turns is None else turns
    for task, score, turn in zip(tasks, scores, every_turn, strict=True):
        grouped.setdefault(str(task), []).append((float(score), float(turn)))
    out: dict[str, float] = {}
    for task, rows in sorted(grouped.items()):
        values = [score for score, _ in rows]
        out[f"{prefix}/{task}/reward"] = sum(values) / len(values)
        out[f"{prefix}/{task}/success"] = sum(v >= 1.0 for v in values) / len(values)
        out[f"{prefix}/{task}/count"] = float(len(values))
        if turns is not None:
            out[f"{prefix}/{task}/turns"] = sum(t for _, t in rows) / len(rows)
    return out
