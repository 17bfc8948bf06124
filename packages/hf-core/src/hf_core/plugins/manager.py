"""Plugin manager: entry-point loading and the registries of engines and protocols.

Backends are found through the ``hybridflow.backends`` entry-point group.  A backend that fails
to import is a loud :class:`PluginLoadError` naming its distribution and entry point (a broken
install should never silently fall back to another engine).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from hf_core.plugins import builtin, hookspecs
from hf_core.protocols.transfer import TransferProtocol

CORE_PLUGIN = "hf-core"


class PluginLoadError(RuntimeError):
    """A backend plugin could not be imported or registered something invalid."""


class UnknownNameError(KeyError):
    """A name asked for (engine, protocol) is not provided by any installed plugin."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass(frozen=True)
class Provided:
    """One registered thing and the plugin that provided it."""

    name: str
    value: Any
    plugin: str


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


@dataclass
class Registry:
    training_engines: dict[str, Provided] = field(default_factory=dict)
    rollout_engines: dict[str, Provided] = field(default_factory=dict)
    protocols: dict[str, Provided] = field(default_factory=dict)
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
    pm: pluggy.PluginManager, hook_name: str, table: dict[str, Provided], kind: str
) -> dict[str, list[str]]:
    """Call each plugin's implementation of one hook, recording who registered what."""
    by_plugin: dict[str, list[str]] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        plugin = impl.plugin_name

        def register(*args: Any, _plugin: str = plugin) -> None:
            if kind == "protocol":
                (value,) = args
                if not isinstance(value, TransferProtocol):
                    raise PluginLoadError(
                        f"plugin {_plugin!r} registered {value!r}, not a TransferProtocol"
                    )
                name = value.name
            else:
                name, value = args
            if name in table:
                raise PluginLoadError(
                    f"{kind} {name!r} is registered by both {table[name].plugin!r} and {_plugin!r}"
                )
            table[name] = Provided(name, value, _plugin)
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
    hooks = [
        ("register_training_engines", registry.training_engines, "training engine"),
        ("register_rollout_engines", registry.rollout_engines, "rollout engine"),
        ("register_protocols", registry.protocols, "protocol"),
    ]
    for hook_name, table, kind in hooks:
        for plugin, names in _collect(pm, hook_name, table, kind).items():
            info = registry.backends.get(plugin)
            if info is not None:
                listing = {
                    "training engine": info.training_engines,
                    "rollout engine": info.rollout_engines,
                    "protocol": info.protocols,
                }[kind]
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


def _lookup(table: dict[str, Provided], name: str, kind: str, hint: str) -> Any:
    if name not in table:
        known = ", ".join(sorted(table)) or "none"
        raise UnknownNameError(
            f"no {kind} named {name!r} is installed (available: {known}). {hint}"
        )
    return table[name].value


def get_protocol(name: str) -> TransferProtocol:
    return _lookup(
        registry().protocols, name, "transfer protocol", "Register new ones via register_protocols."
    )


def get_training_engine(name: str) -> Callable[..., Any]:
    return _lookup(
        registry().training_engines,
        name,
        "training engine",
        f"Install the backend that provides it (e.g. pip install hf-{name}).",
    )


def get_rollout_engine(name: str) -> Callable[..., Any]:
    return _lookup(
        registry().rollout_engines,
        name,
        "rollout engine",
        f"Install the backend that provides it (e.g. pip install hf-{name}).",
    )


def list_backends() -> list[BackendInfo]:
    return list(registry().backends.values())
