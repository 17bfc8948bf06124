"""Per-sample environments for the agent loop: the :class:`Environment` protocol, the table
of environments by name (filled by built-ins and the plugins' ``register_environments``
hook) and :func:`load_environment`, which resolves a recipe's ``agent.environment``.

An environment answers the model in turns: the loop makes one per sample, calls
``reset(prompt)`` with the prompt's text and, after each turn without tool calls,
``step(turn_text)``: an observation for the model, or None when the sample is done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hf_core.errors import ConfigError
from hf_core.imports import resolve
from hf_core.registry import NamedRegistry, UnknownNameError


class Environment(Protocol):
    """A per-sample environment that answers the model in turns."""

    def reset(self, prompt: str) -> None: ...

    def step(self, turn_text: str) -> str | None: ...


EnvironmentFactory = Callable[[], Environment]
"""A class (or any callable) making one environment per sample, without arguments."""


class UnknownEnvironmentError(ConfigError, UnknownNameError):
    """A recipe names an environment that is neither registered nor an importable class."""


ENVIRONMENTS: NamedRegistry[EnvironmentFactory] = NamedRegistry(
    "environment",
    miss_error=UnknownEnvironmentError,
    miss_hint="register it with the register_environments plugin hook or give "
    "'package.module:Class'",
)


def register_environment(
    name: str, factory: EnvironmentFactory, *, owner: str = "", override: bool = False
) -> EnvironmentFactory:
    """Add an environment to the table (what the ``register_environments`` hook's
    ``register`` does); registering the same factory again is a no-op."""
    if not callable(factory):
        raise TypeError(f"environment {name!r}: {factory!r} is not a class or a callable")
    if ENVIRONMENTS.holds(name, factory):
        return factory
    return ENVIRONMENTS.add(name, factory, owner=owner, override=override)


def load_environment(spec: str, key: str = "agent.environment") -> EnvironmentFactory:
    """The environment factory ``spec`` names: a registered name or ``package.module:Class``."""
    found = resolve(
        spec,
        key=key,
        table=ENVIRONMENTS,
        error=UnknownEnvironmentError,
        accept=callable,
        expected="a class",
        form="'package.module:Class'",
    )
    return found.value  # type: ignore[no-any-return]
