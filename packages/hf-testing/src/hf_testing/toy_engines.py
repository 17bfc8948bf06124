"""Toy engines registered by name, for tests of core's checks and placement.

A backend registers an engine in three of the plugin registry's tables (the factory, its
settings model, its parallel axes); tests that stand in toy engines for real backends do the
same through :func:`register_toy_engine`, one call per engine.  Call it between
``hf_core.plugins.reset()`` calls (a fixture's set-up), so the toys never outlive the test.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from hf_core import plugins


def register_toy_engine(
    kind: Literal["training", "rollout"],
    name: str,
    factory: Any = dict,
    *,
    settings: type | None = None,
    axes: Iterable[str] = (),
) -> None:
    """Register ``factory`` as the ``kind`` engine ``name``, with its settings model (none: the
    engine checks its own) and the parallel axes it declares (none: data parallel only)."""
    reg = plugins.registry()
    if kind == "training":
        engines, configs, parallel = (
            reg.training_engines,
            reg.training_engine_configs,
            reg.training_engine_parallel,
        )
    else:
        engines, configs, parallel = (
            reg.rollout_engines,
            reg.rollout_engine_configs,
            reg.rollout_engine_parallel,
        )
    engines.add(name, factory, owner="test")
    if settings is not None:
        configs.add(name, settings, owner="test")
    parallel[name] = frozenset(axes)
