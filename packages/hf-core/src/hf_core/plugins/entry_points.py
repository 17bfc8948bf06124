"""Which installed plugins load: the entry points of the ``hybridflow.plugins`` group (and of
its old name, ``hybridflow.backends``, for one more release), limited by
``HYBRIDFLOW_PLUGINS``.

A distribution still declaring the old group gets a :class:`DeprecationWarning` (also logged,
since warnings of this class are hidden outside ``__main__``) naming the group to move to; one
declaring both loads once, from the new group, without a warning.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import warnings
from dataclasses import dataclass

from hf_core.plugins.hookspecs import (
    DEPRECATED_ENTRY_POINT_GROUP,
    DEPRECATED_GROUP_REMOVED_IN,
    ENTRY_POINT_GROUP,
)

log = logging.getLogger(__name__)

CORE_PLUGIN = "hf-core"
PLUGINS_ENV = "HYBRIDFLOW_PLUGINS"
"""Comma-separated entry-point names: only these plugins load (hf-core's own always does)."""


class PluginLoadError(RuntimeError):
    """A plugin could not be imported or registered something invalid."""


@dataclass(frozen=True)
class PluginEntryPoint:
    """One installed plugin's entry point and the group it was found in."""

    entry_point: md.EntryPoint
    group: str

    @property
    def name(self) -> str:
        return self.entry_point.name

    @property
    def distribution(self) -> str:
        dist = self.entry_point.dist
        return dist.name if dist is not None else "<unknown distribution>"

    @property
    def version(self) -> str:
        dist = self.entry_point.dist
        return dist.version if dist is not None else "?"


def deprecation_message(entry: PluginEntryPoint) -> str:
    return (
        f"HybridFlow plugin {entry.name!r} from distribution {entry.distribution} "
        f"{entry.version} is declared in the entry-point group {entry.group!r}, which is "
        f"deprecated and no longer read from HybridFlow {DEPRECATED_GROUP_REMOVED_IN}: declare "
        f'it under [project.entry-points."{ENTRY_POINT_GROUP}"] instead'
    )


def plugin_entry_points() -> list[PluginEntryPoint]:
    """The entry points to load, in discovery order: the new group's, then the old group's
    that the new one does not hold, filtered by ``HYBRIDFLOW_PLUGINS``; each one loaded from
    the old group is warned about."""
    current = [PluginEntryPoint(ep, ENTRY_POINT_GROUP) for ep in _group(ENTRY_POINT_GROUP)]
    seen = {(e.name, e.distribution) for e in current}
    old = [
        PluginEntryPoint(ep, DEPRECATED_ENTRY_POINT_GROUP)
        for ep in _group(DEPRECATED_ENTRY_POINT_GROUP)
    ]
    points = current + [e for e in old if (e.name, e.distribution) not in seen]
    selected = _selected([e.name for e in points])
    points = [e for e in points if selected is None or e.name in selected]
    for entry in points:
        if entry.group == DEPRECATED_ENTRY_POINT_GROUP:
            message = deprecation_message(entry)
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            log.warning("%s", message)
    return points


def _group(group: str) -> list[md.EntryPoint]:
    return list(md.entry_points(group=group))


def _selected(names: list[str]) -> set[str] | None:
    """The entry-point names ``HYBRIDFLOW_PLUGINS`` allows (None: all)."""
    raw = os.environ.get(PLUGINS_ENV, "").strip()
    if not raw:
        return None
    wanted = {n.strip() for n in raw.split(",") if n.strip()} - {CORE_PLUGIN}
    if unknown := sorted(wanted - set(names)):
        raise PluginLoadError(
            f"{PLUGINS_ENV} names {', '.join(unknown)}, which no installed distribution "
            f"provides; installed plugins: {', '.join(sorted(names)) or '(none)'}"
        )
    return wanted
