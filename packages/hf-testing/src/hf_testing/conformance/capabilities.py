"""Checks that an engine's optional features are the capability protocols, whole and well typed.

``isinstance(engine, Protocol)`` only asks whether the attributes exist.  These helpers also
catch the mistakes that make core silently skip a feature: a half-implemented protocol
(``offload`` without ``onload``), a misspelt method, or a signature core cannot call.
"""

from __future__ import annotations

import inspect
from typing import Any


def protocol_methods(protocol: type) -> list[str]:
    """The methods a capability protocol asks for (its own, not ``Protocol``'s)."""
    return sorted(
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and inspect.isfunction(value)
    )


def signature_problems(engine: Any, protocol: type) -> list[str]:
    """Why core could not call ``engine``'s methods the way ``protocol`` declares them."""
    problems = []
    for name in protocol_methods(protocol):
        method = getattr(engine, name, None)
        if not callable(method):
            problems.append(f"{name} is not a method")
            continue
        wanted = list(inspect.signature(getattr(protocol, name)).parameters.values())[1:]
        got = inspect.signature(method).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in got.values())
        for param in wanted:
            if param.name not in got and not takes_kwargs:
                problems.append(f"{name}() lacks parameter {param.name!r}")
        for param in got.values():
            plain = param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            extra = param.name not in {p.name for p in wanted}
            if plain and extra and param.default is param.empty:
                problems.append(f"{name}() requires {param.name!r}, which core never passes")
    return problems


def capability_report(engine: Any, protocols: tuple[type, ...]) -> tuple[set[type], list[str]]:
    """The protocols ``engine`` satisfies, and every problem with those it half-implements."""
    satisfied: set[type] = set()
    problems: list[str] = []
    for protocol in protocols:
        present = [m for m in protocol_methods(protocol) if hasattr(engine, m)]
        if isinstance(engine, protocol):
            satisfied.add(protocol)
            problems += [f"{protocol.__name__}: {p}" for p in signature_problems(engine, protocol)]
        elif present:
            missing = sorted(set(protocol_methods(protocol)) - set(present))
            problems.append(f"{protocol.__name__}: has {present} but not {missing}")
    return satisfied, problems
