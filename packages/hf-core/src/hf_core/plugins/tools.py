"""Tools by name for a recipe's ``agent.tools``: a name is looked up in the agents' tool
table (:mod:`hf_core.agents.tools`, which the plugins' ``register_tools`` hooks fill when the
plugin manager loads: :mod:`hf_core.plugins.manager`), a ``module:function`` path is imported.

This lives with the plugins, not the agents, so that the dependency points one way: plugins
know the extension points they fill, the agent loop only receives resolved tools.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from hf_core.agents.tools import TOOLS, Tool, registered_names
from hf_core.errors import ConfigError
from hf_core.imports import resolve_function
from hf_core.plugins import manager as _manager  # noqa: F401  (installs the tables' loader)


def tool_names() -> list[str]:
    return registered_names()


def get_tool(spec: str, key: str = "agent.tools") -> Tool:
    """A registered tool by name, or ``package.module:function`` imported (named after the
    function): :func:`hf_core.imports.resolve_function`."""
    found = resolve_function(spec, key=key, table=TOOLS)
    if not found.imported or isinstance(found.value, Tool):
        return found.value  # type: ignore[no-any-return]
    return Tool(found.name, found.value, inspect.getdoc(found.value) or "")


def resolve_tools(specs: Sequence[str]) -> dict[str, Tool]:
    """The recipe's ``agent.tools`` as name -> tool; two tools with one name is an error."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = get_tool(spec)
        if tool.name in tools:
            raise ConfigError(f"agent.tools: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools
