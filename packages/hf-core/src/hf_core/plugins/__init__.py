"""Plugins: hook specifications, entry-point loading and registries (pluggy)."""

from hf_core.plugins.backend_info import BackendInfo
from hf_core.plugins.entry_points import PluginLoadError
from hf_core.plugins.hookspecs import (
    DEPRECATED_ENTRY_POINT_GROUP,
    ENTRY_POINT_GROUP,
    hookimpl,
    hookspec,
)
from hf_core.plugins.manager import (
    UnknownEngineError,
    UnknownNameError,
    add_plugin,
    get_engine_config,
    get_engine_parallelism,
    get_protocol,
    get_rollout_engine,
    get_training_engine,
    list_backends,
    plugin_manager,
    registry,
    reset,
    validated_engine_settings,
)

__all__ = [
    "DEPRECATED_ENTRY_POINT_GROUP",
    "ENTRY_POINT_GROUP",
    "BackendInfo",
    "PluginLoadError",
    "UnknownEngineError",
    "UnknownNameError",
    "add_plugin",
    "get_engine_config",
    "get_engine_parallelism",
    "get_protocol",
    "get_rollout_engine",
    "get_training_engine",
    "hookimpl",
    "hookspec",
    "list_backends",
    "plugin_manager",
    "registry",
    "reset",
    "validated_engine_settings",
]
