"""The hooks whose entries live in their own modules' tables: advantage estimators, policy
losses, KL estimators, aggregation modes, reward functions, agent tools, agent environments and
task environment kinds.

Those tables sit below the plugin layer (the algorithms, rewards and agents work without it),
so this module fills them from the hooks and installs the loader each table calls before a
lookup misses (:meth:`hf_core.registry.NamedRegistry.set_loader`): the dependency points one
way, and a worker process finds a plugin's entries without importing it by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from hf_core.agents.environment import ENVIRONMENTS, register_environment
from hf_core.agents.tools import TOOLS, register_tool
from hf_core.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    ESTIMATOR_TRAITS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    EstimatorTraits,
    add_advantage_estimator,
    add_aggregation_mode,
    add_kl_estimator,
    add_policy_loss,
)
from hf_core.environments.base import ENV_KINDS, register_env_kind
from hf_core.plugins.backend_info import BackendInfo
from hf_core.plugins.entry_points import PluginLoadError
from hf_core.registry import DuplicateNameError, NamedRegistry
from hf_core.rewards.registry import REWARD_FUNCTIONS, add_reward_function


def _estimator(
    plugin: str,
    name: str,
    fn: Any,
    needs_critic: bool = False,
    needs_groups: bool = False,
    needs_greedy_baseline: bool = False,
) -> None:
    traits = EstimatorTraits(needs_critic, needs_groups, needs_greedy_baseline)
    add_advantage_estimator(name, fn, traits, owner=plugin)


def _policy_loss(plugin: str, name: str, fn: Any) -> None:
    add_policy_loss(name, fn, owner=plugin)


def _kl_estimator(plugin: str, name: str, fn: Any) -> None:
    add_kl_estimator(name, fn, owner=plugin)


def _aggregation_mode(plugin: str, name: str, fn: Any) -> None:
    add_aggregation_mode(name, fn, owner=plugin)


def _reward(plugin: str, name: str, fn: Any, batched: bool = True) -> None:
    add_reward_function(name, fn, batched=batched, owner=plugin)


def _tool(
    plugin: str,
    name: str,
    fn: Any,
    description: str = "",
    parameters: dict[str, Any] | None = None,
) -> None:
    if name in TOOLS and TOOLS.get(name).fn is fn:
        return  # registered again after the plugins were reset
    register_tool(name, fn, description, parameters, owner=plugin)


def _environment(plugin: str, name: str, factory: Any) -> None:
    register_environment(name, factory, owner=plugin)


def _env_kind(plugin: str, name: str, cls: Any) -> None:
    register_env_kind(name, cls, owner=plugin)


@dataclass(frozen=True)
class Extension:
    """One hook: how its ``register(name, fn, ...)`` adds to the table, and the
    :class:`BackendInfo` list naming what each plugin added."""

    hook: str
    add: Callable[..., None]
    listing: str
    table: NamedRegistry[Any]


EXTENSIONS = (
    Extension(
        "register_advantage_estimators", _estimator, "advantage_estimators", ADVANTAGE_ESTIMATORS
    ),
    Extension("register_policy_losses", _policy_loss, "policy_losses", POLICY_LOSSES),
    Extension("register_kl_estimators", _kl_estimator, "kl_estimators", KL_ESTIMATORS),
    Extension(
        "register_aggregation_modes", _aggregation_mode, "aggregation_modes", AGGREGATION_MODES
    ),
    Extension("register_reward_functions", _reward, "reward_functions", REWARD_FUNCTIONS),
    Extension("register_tools", _tool, "tools", TOOLS),
    Extension("register_environments", _environment, "environments", ENVIRONMENTS),
    Extension("register_env_kinds", _env_kind, "env_kinds", ENV_KINDS),
)

TABLES_WITH_PLUGINS: tuple[NamedRegistry[Any], ...] = (
    *(e.table for e in EXTENSIONS),
    ESTIMATOR_TRAITS,
)
"""Every table a plugin's hook fills: each asks the plugin manager to load before a miss."""


_ADDED: list[tuple[NamedRegistry[Any], str]] = []
"""(table, name) of every entry a plugin added, so that :func:`forget_plugin_entries` can
take them out again."""


def forget_plugin_entries() -> None:
    """Take every plugin's entries out of the tables (built-ins registered where they are
    defined stay): after :func:`hf_core.plugins.reset`, what loads next registers afresh, and
    a plugin that is gone leaves nothing behind."""
    while _ADDED:
        table, name = _ADDED.pop()
        table.remove(name)


def call_hook(impl: Any, register: Callable[..., None], hook_name: str) -> None:
    """One plugin's implementation of a hook; what it raises becomes a
    :class:`PluginLoadError` naming the plugin and the hook."""
    try:
        impl.function(register=register)
    except PluginLoadError:
        raise
    except Exception as exc:
        raise PluginLoadError(
            f"plugin {impl.plugin_name!r} failed in hook {hook_name}: {type(exc).__name__}: {exc}"
        ) from exc


def register_extensions(
    pm: pluggy.PluginManager, backends: dict[str, BackendInfo], only: str | None = None
) -> None:
    """Call every plugin's (``only``: that plugin's) extension hooks, adding to the tables
    under the plugin's name and listing what each added in its :class:`BackendInfo`."""
    for extension in EXTENSIONS:
        for impl in getattr(pm.hook, extension.hook).get_hookimpls():
            plugin = impl.plugin_name
            if only is not None and plugin != only:
                continue
            names: list[str] = []
            call_hook(impl, _register_for(plugin, extension, names), extension.hook)
            info = backends.get(plugin)
            if info is not None:
                getattr(info, extension.listing).extend(names)


def _register_for(plugin: str, extension: Extension, names: list[str]) -> Callable[..., None]:
    """The ``register`` one plugin's hook receives: checks, adds, and records the name."""

    def register(name: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        if not callable(fn):
            raise PluginLoadError(f"plugin {plugin!r} registered {name!r} as {fn!r}")
        try:
            extension.add(plugin, name, fn, *args, **kwargs)
        except (DuplicateNameError, ValueError) as exc:
            raise PluginLoadError(f"plugin {plugin!r}: {exc}") from None
        if extension.table.owner(name) == plugin:  # not a built-in it registered again
            _ADDED.append((extension.table, name))
            if extension.table is ADVANTAGE_ESTIMATORS:
                _ADDED.append((ESTIMATOR_TRAITS, name))
        names.append(name)

    return register


def list_core_builtins(info: BackendInfo) -> None:
    """hf-core's own entries registered where they are defined (estimators, losses, KL
    estimators, aggregation modes, rewards), in its row of ``hybridflow backends``."""
    for extension in EXTENSIONS:
        table = extension.table
        builtins = [n for n in table.names() if table.owner(n).startswith("hf_core.")]
        getattr(info, extension.listing).extend(builtins)
