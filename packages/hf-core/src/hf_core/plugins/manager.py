"""Plugin manager: entry-point loading and the registries of engines and protocols.

Backends are found through the ``hybridflow.backends`` entry-point group.  A backend that fails
to import is a loud :class:`PluginLoadError` naming its distribution and entry point (a broken
install should never silently fall back to another engine).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy
from pydantic import BaseModel

from hf_core.plugins import builtin, hookspecs
from hf_core.protocols.transfer import TransferProtocol
from hf_core.registry import DuplicateNameError, NamedRegistry, UnknownNameError

CORE_PLUGIN = "hf-core"


class PluginLoadError(RuntimeError):
    """A backend plugin could not be imported or registered something invalid."""


class UnknownEngineError(UnknownNameError):
    """A name asked for (engine, protocol) is not provided by any installed plugin."""


@dataclass
class BackendInfo:
    """What ``hybridflow backends`` prints for one plugin."""

    plugin: str
    distribution: str
    version: str
    entry_point: str
    training_engines: list[str] = field(default_factory=list)
    rollout_engines: list[str] = field(default_factory=list)
    protocols: list[str] = field(default_factory=list)


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
    """Model-parallel axes (``tp``, ``pp``) each training engine can split a model over."""
    rollout_engine_parallel: dict[str, frozenset[str]] = field(default_factory=dict)
    """Generation axes each rollout engine can form across ranks (``tp``: it loads TP slices)."""
    protocols: NamedRegistry[TransferProtocol] = field(
        default_factory=lambda: _table(
            "transfer protocol", "register new ones via the register_protocols hook"
        )
    )
    backends: dict[str, BackendInfo] = field(default_factory=dict)


def _load_entry_points(pm: pluggy.PluginManager, registry: Registry) -> None:
    for ep in md.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
        version = ep.dist.version if ep.dist is not None else "?"
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginLoadError(
                f"HybridFlow backend plugin {ep.name!r} (entry point {ep.value!r} in group "
                f"{hookspecs.ENTRY_POINT_GROUP!r}) from distribution {dist} {version} failed to "
                f"import: {type(exc).__name__}: {exc}"
            ) from exc
        if pm.is_registered(plugin) or pm.get_plugin(ep.name) is not None:
            continue
        try:
            pm.register(plugin, name=ep.name)
        except Exception as exc:
            raise PluginLoadError(
                f"HybridFlow backend plugin {ep.name!r} from distribution {dist} {version} "
                f"has invalid hooks: {exc}"
            ) from exc
        registry.backends[ep.name] = BackendInfo(ep.name, dist, version, ep.value)


def _collect(
    pm: pluggy.PluginManager,
    hook_name: str,
    table: NamedRegistry[Any],
    configs: NamedRegistry[ConfigRef] | None,
    parallel_table: dict[str, frozenset[str]] | None = None,
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

        try:
            impl.function(register=register)
        except PluginLoadError:
            raise
        except Exception as exc:
            raise PluginLoadError(
                f"plugin {plugin!r} failed in hook {hook_name}: {type(exc).__name__}: {exc}"
            ) from exc
    return by_plugin


PARALLEL_AXES = frozenset({"tp", "pp"})


def _parallel_axes(axes: Any, plugin: str, name: str) -> frozenset[str]:
    """Validate an engine's declared parallel axes (a collection of ``tp`` / ``pp``)."""
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
    for hook_name, table, configs, axes in hooks:
        for plugin, names in _collect(pm, hook_name, table, configs, axes).items():
            info = registry.backends.get(plugin)
            if info is not None:
                listing = {
                    "register_training_engines": info.training_engines,
                    "register_rollout_engines": info.rollout_engines,
                    "register_protocols": info.protocols,
                }[hook_name]
                listing.extend(names)
    return pm, registry


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


@functools.cache
def _state() -> tuple[pluggy.PluginManager, Registry]:
    return _build()


def plugin_manager() -> pluggy.PluginManager:
    return _state()[0]


def registry() -> Registry:
    return _state()[1]


def reset() -> None:
    """Forget loaded plugins (tests that install a plugin at run time call this)."""
    _state.cache_clear()


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


def get_engine_parallelism(kind: Literal["training", "rollout"], name: str) -> frozenset[str]:
    """The parallel axes engine ``name`` declared (``tp``, ``pp``); empty: data parallel only.

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
    module_name, _, attr = path.partition(":")
    try:
        model = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PluginLoadError(
            f"plugin {plugin!r}: the config model {path!r} of engine {engine!r} cannot be "
            f"imported: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginLoadError(
            f"plugin {plugin!r}: {path!r} (config of engine {engine!r}) is not a pydantic model"
        )
    return model


def list_backends() -> list[BackendInfo]:
    return list(registry().backends.values())
