"""Task environments from the libraries users already have (``env:`` in a recipe): the
prompts of a run and the library's own scoring of the answers (:mod:`.base`).  Built-in kinds:
``reasoning_gym`` (:mod:`.reasoning_gym`, the ``hf-core[reasoning-gym]`` extra), and two that run
multi-turn episodes against the policy endpoint: ``openenv`` (:mod:`.openenv_env`,
``hf-core[openenv]``) and ``verifiers`` (:mod:`.verifiers_env`, ``hf-core[verifiers]``)."""

from hf_core.environments.base import (
    ENV_KINDS,
    ENV_TASK_KEY,
    RolloutEnvironment,
    Split,
    TaskEnvironment,
    UnknownEnvKindError,
    build_environment,
    kind_runs_rollouts,
    register_env_kind,
    runs_rollouts,
    task_metrics,
)

__all__ = [
    "ENV_KINDS",
    "ENV_TASK_KEY",
    "RolloutEnvironment",
    "Split",
    "TaskEnvironment",
    "UnknownEnvKindError",
    "build_environment",
    "kind_runs_rollouts",
    "register_env_kind",
    "runs_rollouts",
    "task_metrics",
]
