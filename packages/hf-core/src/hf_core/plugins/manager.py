"""Plugin manager: entry-point loading and the registries of everything plugins provide.

Plugins are found through the ``hybridflow.plugins`` entry-point group (and its deprecated
old name, :mod:`hf_core.plugins.entry_points`); ``HYBRIDFLOW_PLUGINS`` (a comma-separated list
of entry-point names) limits which load.  A plugin that fails to import is reported once (a
warning naming its distribution, entry point and error) and skipped, so one broken
third-party package does not stop runs that do not use it; a recipe that names something only
it would have provided fails on the lookup, whose message lists the skipped plugins and why.
A plugin that imports but registers something invalid is a loud :class:`PluginLoadError`.

Engines, engine settings and protocols live in :class:`Registry` (rebuilt with the manager);
advantage estimators, policy losses, KL estimators, aggregation modes, reward functions, tools
and environments live in their own modules' tables, which :mod:`hf_core.plugins.extensions`
fills from the hooks and asks to load the plugins before a lookup misses, so the dependency
points one way.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy
from pydantic import BaseModel

from hf_core.imports import resolve
from hf_core.plugins import builtin, hookspecs
from hf_core.plugins.backend_info import BackendInfo
from hf_core.plugins.entry_points import (
    CORE_PLUGIN,
    PluginLoadError,
    plugin_entry_points,
)
from hf_core.plugins.extensions import (
    TABLES_WITH_PLUGINS,
    call_hook,
    forget_plugin_entries,
    list_core_builtins,
    register_extensions,
)
from hf_core.protocols.transfer import TransferProtocol
from hf_core.registry import DuplicateNameError, NamedRegistry, UnknownNameError

log = logging.getLogger(__name__)


class UnknownEngineError(UnknownNameError):
    """A name asked for (engine, protocol) is not provided by any installed plugin."""


ConfigRef = type[BaseModel] | str
"""An engine's settings model, or its import path ``"package.module:Class"`` (so that loading
a plugin stays cheap: the model is imported only when a recipe is checked)."""


def _table(kind: str, hint: str) -> NamedRegistry[Any]:
    return NamedRegistry(kind, miss_error=UnknownEngineError, miss_hint=hint)


_INSTALL_HINT = "install the backend that provides it (e.g. pip install hf-<backend>)"


@dataclass
class Registry:
    """Everything the installed plugins provide, each table remembering which plugin did."""

    training_engines: NamedRegistry[Callable[..., Any]] = field(
        default_factory=lambda: _table("training engine", _INSTALL_HINT)
    )
    rollout_engines: NamedRegistry[Callable[..., Any]] = field(
        default_factory=lambda: _table("rollout engine", _INSTALL_HINT)
    )
    training_engine_configs: NamedRegistry[ConfigRef] = field(
        default_factory=lambda: _table("training engine config", _INSTALL_HINT)
    )
    rollout_engine_configs: NamedRegistry[ConfigRef] = field(
        default_factory=lambda: _table("rollout engine config", _INSTALL_HINT)
    )
    training_engine_parallel: dict[str, frozenset[str]] = field(default_factory=dict)
    """Parallel axes each training engine can split a model (``tp``, ``pp``) or a sequence
    (``sp``) over."""
    rollout_engine_parallel: dict[str, frozenset[str]] = field(default_factory=dict)
    """Generation axes each rollout engine can form across ranks (``tp``: it loads TP slices)."""
    protocols: NamedRegistry[TransferProtocol] = field(
        default_factory=lambda: _table(
            "transfer protocol", "register new ones via the register_protocols hook"
        )
    )
    backends: dict[str, BackendInfo] = field(default_factory=dict)


def _load_entry_points(pm: pluggy.PluginManager, registry: Registry) -> None:
    for entry in plugin_entry_points():
        ep, dist, version = entry.entry_point, entry.distribution, entry.version
        try:
            plugin = ep.load()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            registry.backends[ep.name] = BackendInfo(
                ep.name, dist, version, ep.value, error=error, group=entry.group
            )
            log.warning(
                "HybridFlow plugin %r (entry point %r in group %r) from distribution %s %s "
                "failed to import and is skipped: %s",
                ep.name,
                ep.value,
                entry.group,
                dist,
                version,
                error,
            )
            continue
        if pm.is_registered(plugin) or pm.get_plugin(ep.name) is not None:
            continue
        try:
            pm.register(plugin, name=ep.name)
        except Exception as exc:
            raise PluginLoadError(
                f"HybridFlow plugin {ep.name!r} from distribution {dist} {version} "
                f"has invalid hooks: {exc}"
            ) from exc
        registry.backends[ep.name] = BackendInfo(
            ep.name, dist, version, ep.value, group=entry.group
        )


def skipped_plugins_note() -> str:
    """The plugins that failed to import, for a lookup miss's message ("" when none)."""
    broken = [info for info in _state()[1].backends.values() if info.error]
    if not broken:
        return ""
    return "plugins that failed to import and were skipped: " + "; ".join(
        f"{b.plugin!r} from {b.distribution} {b.version} ({b.entry_point}): {b.error}"
        for b in broken
    )


def _collect(
    pm: pluggy.PluginManager,
    hook_name: str,
    table: NamedRegistry[Any],
    configs: NamedRegistry[ConfigRef] | None,
    parallel_table: dict[str, frozenset[str]] | None = None,
    only: str | None = None,
) -> dict[str, list[str]]:
    """Call each plugin's implementation of one hook, recording who registered what.

    Engine hooks take ``register(name, factory, config=ConfigModel, parallel=("tp", "pp"))``:
    the optional pydantic model of the engine's settings, so a recipe's ``engine:`` block is
    checked at load time, and the parallel axes the engine supports, so recipes and the
    auto-mapping planner only ask for layouts it can run.
    """
    by_plugin: dict[str, list[str]] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        plugin = impl.plugin_name
        if only is not None and plugin != only:
            continue

        def register(
            *args: Any, _plugin: str = plugin, config: Any = None, parallel: Any = ()
        ) -> None:
            axes_table = parallel_table
            if configs is None:
                (value,) = args
                if not isinstance(value, TransferProtocol):
                    raise PluginLoadError(
                        f"plugin {_plugin!r} registered {value!r}, not a TransferProtocol"
                    )
                name = value.name
            else:
                name, value = args
                if config is not None and not (
                    (isinstance(config, str) and ":" in config)
                    or (isinstance(config, type) and issubclass(config, BaseModel))
                ):
                    raise PluginLoadError(
                        f"plugin {_plugin!r}: the config of {table.kind} {name!r} must be a "
                        f"pydantic model class or 'module:Class', got {config!r}"
                    )
            try:
                table.add(name, value, owner=_plugin)
            except DuplicateNameError as exc:
                raise PluginLoadError(str(exc)) from None
            if configs is not None and config is not None:
                configs.add(name, config, owner=_plugin)
            if axes_table is not None:
                axes_table[name] = _parallel_axes(parallel, _plugin, name)
            by_plugin.setdefault(_plugin, []).append(name)

        call_hook(impl, register, hook_name)
    return by_plugin


PARALLEL_AXES = frozenset({"tp", "pp", "sp", "ep"})
"""Tensor and pipeline parallelism split a model's weights; sequence parallelism (training
engines only) splits each sequence's tokens."""


def _parallel_axes(axes: Any, plugin: str, name: str) -> frozenset[str]:
    """Validate an engine's declared parallel axes (a collection of ``tp`` / ``pp`` / ``sp``)."""
    if isinstance(axes, str) or not all(isinstance(a, str) for a in axes):
        raise PluginLoadError(
            f"plugin {plugin!r}: parallel= of engine {name!r} must be a tuple of axis names "
            f"such as ('tp', 'pp'), got {axes!r}"
        )
    unknown = sorted(set(axes) - PARALLEL_AXES)
    if unknown:
        raise PluginLoadError(
            f"plugin {plugin!r}: engine {name!r} declares unknown parallel axes {unknown}; "
            f"known: {sorted(PARALLEL_AXES)}"
        )
    return frozenset(axes)


def _build() -> tuple[pluggy.PluginManager, Registry]:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    pm.register(builtin, name=CORE_PLUGIN)
    core = md.distribution("hf-core") if _installed("hf-core") else None
    registry.backends[CORE_PLUGIN] = BackendInfo(
        CORE_PLUGIN, "hf-core", core.version if core else "?", "hf_core.plugins.builtin"
    )
    _load_entry_points(pm, registry)
    _collect_hooks(pm, registry)
    list_core_builtins(registry.backends[CORE_PLUGIN])
    return pm, registry


def _collect_hooks(pm: pluggy.PluginManager, registry: Registry, only: str | None = None) -> None:
    """Call the registered plugins' hooks (``only``: that plugin's), filling every table."""
    hooks: list[
        tuple[
            str,
            NamedRegistry[Any],
            NamedRegistry[ConfigRef] | None,
            dict[str, frozenset[str]] | None,
        ]
    ] = [
        (
            "register_training_engines",
            registry.training_engines,
            registry.training_engine_configs,
            registry.training_engine_parallel,
        ),
        (
            "register_rollout_engines",
            registry.rollout_engines,
            registry.rollout_engine_configs,
            registry.rollout_engine_parallel,
        ),
        ("register_protocols", registry.protocols, None, None),
    ]
    register_extensions(pm, registry.backends, only)
    for hook_name, table, configs, axes in hooks:
        for plugin, names in _collect(pm, hook_name, table, configs, axes, only).items():
            info = registry.backends.get(plugin)
            if info is not None:
                listing = {
                    "register_training_engines": info.training_engines,
                    "register_rollout_engines": info.rollout_engines,
                    "register_protocols": info.protocols,
                }[hook_name]
                listing.extend(names)


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


_building = False


@functools.cache
def _state() -> tuple[pluggy.PluginManager, Registry]:
    global _building
    _building = True
    try:
        return _build()
    finally:
        _building = False


def _load_plugins() -> None:
    """What the tables plugins fill (:data:`TABLES_WITH_PLUGINS`) call before a lookup misses."""
    if not _building:
        _state()


def _skipped_note() -> str:
    return "" if _building else skipped_plugins_note()


for _table_with_plugins in TABLES_WITH_PLUGINS:
    _table_with_plugins.set_loader(_load_plugins, _skipped_note)


def plugin_manager() -> pluggy.PluginManager:
    return _state()[0]


def registry() -> Registry:
    return _state()[1]


def add_plugin(plugin: object, name: str) -> None:
    """Register a plugin object at run time (a notebook, a test) beside the installed ones:
    its hooks are called now; :func:`reset` forgets it."""
    pm, registry = _state()
    pm.register(plugin, name=name)
    registry.backends[name] = BackendInfo(name, "<added at run time>", "-", repr(plugin))
    _collect_hooks(pm, registry, only=name)


def reset() -> None:
    """Forget loaded plugins and what they registered (tests that install a plugin at run
    time call this); the next lookup loads the installed ones again."""
    _state.cache_clear()
    forget_plugin_entries()


def get_protocol(name: str) -> TransferProtocol:
    return registry().protocols.get(name)


def get_training_engine(name: str) -> Callable[..., Any]:
    return registry().training_engines.get(name)


def get_rollout_engine(name: str) -> Callable[..., Any]:
    return registry().rollout_engines.get(name)


def get_engine_config(kind: Literal["training", "rollout"], name: str) -> type[BaseModel] | None:
    """The settings model a plugin registered with engine ``name``, or None if it gave none."""
    if kind == "training":
        get_training_engine(name)  # an unknown engine is an error, not "no config"
        configs = registry().training_engine_configs
    else:
        get_rollout_engine(name)
        configs = registry().rollout_engine_configs
    if name not in configs:
        return None
    ref = configs.get(name)
    return ref if isinstance(ref, type) else _import_config(ref, configs.owner(name), name)


def validated_engine_settings(
    kind: Literal["training", "rollout"], backend: str, block: Callable[[], dict[str, Any]]
) -> Any:
    """Engine ``backend``'s settings validated from ``block()``, or None when the engine is
    not installed here (building the workers will say so) or registered no settings model.
    ``block`` is called only then: core's engine arguments ask the registry too."""
    try:
        model = get_engine_config(kind, backend)
        return None if model is None else model.model_validate(block())
    except UnknownEngineError:
        return None


def get_engine_parallelism(kind: Literal["training", "rollout"], name: str) -> frozenset[str]:
    """The parallel axes engine ``name`` declared (``tp``, ``pp``, ``sp``); empty: data
    parallel only.

    A training engine with ``tp`` / ``pp`` splits the model over ranks (and reshards it for
    generation); a rollout engine with ``tp`` forms one engine over ``t_g`` consecutive ranks
    and loads the generation TP slices of a reshard.
    """
    if kind == "training":
        get_training_engine(name)
        return registry().training_engine_parallel.get(name, frozenset())
    get_rollout_engine(name)
    return registry().rollout_engine_parallel.get(name, frozenset())


def _import_config(path: str, plugin: str, engine: str) -> type[BaseModel]:
    """A settings model a plugin named as ``module:Class``, imported on first use."""
    found = resolve(
        path,
        key=f"the settings model of engine {engine!r} (plugin {plugin!r})",
        error=PluginLoadError,
        accept=lambda obj: isinstance(obj, type) and issubclass(obj, BaseModel),
        expected="a pydantic model class",
        form="'package.module:Class'",
    )
    return found.value  # type: ignore[no-any-return]


def list_backends() -> list[BackendInfo]:
    return list(registry().backends.values())
