"""Tools by name for a recipe's ``agent.tools``: a name is looked up in the agents' tool
table (:mod:`hf_core.agents.tools`, which the plugins' ``register_tools`` hooks fill when the
plugin manager loads: :mod:`hf_core.plugins.manager`), a ``module:function`` path is imported.

This lives with the plugins, not the agents, so that the dependency points one way: plugins
know the extension points they fill, the agent loop only receives resolved tools.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from hf_core.agents.tools import Tool, UnknownToolError, registered_names, registered_tool
from hf_core.errors import ConfigError
from hf_core.imports import import_object
from hf_core.plugins import manager as _manager  # noqa: F401  (installs the tables' loader)


def tool_names() -> list[str]:
    return registered_names()


def get_tool(spec: str) -> Tool:
    """A registered tool by name, or ``package.module:function`` imported (named after the
    function)."""
    if ":" not in spec:
        return registered_tool(spec)
    try:
        obj: Any = import_object(spec)
    except (ImportError, AttributeError) as e:
        raise UnknownToolError(f"tool {spec!r}: cannot import it: {e}") from e
    if isinstance(obj, Tool):
        return obj
    if not callable(obj):
        raise UnknownToolError(f"tool {spec!r} is a {type(obj).__name__}, not a callable")
    return Tool(spec.rpartition(":")[2].split(".")[-1], obj, inspect.getdoc(obj) or "")


def resolve_tools(specs: Sequence[str]) -> dict[str, Tool]:
    """The recipe's ``agent.tools`` as name -> tool; two tools with one name is an error."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = get_tool(spec)
        if tool.name in tools:
            raise ConfigError(f"agent.tools: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools
