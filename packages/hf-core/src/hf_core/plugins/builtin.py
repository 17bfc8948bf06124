"""hf-core's own contributions, registered like any plugin (the built-in protocols)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_core.plugins.hookspecs import hookimpl
from hf_core.protocols.transfer import BUILTIN_PROTOCOLS


@hookimpl
def register_protocols(register: Callable[[Any], None]) -> None:
    for protocol in BUILTIN_PROTOCOLS:
        register(protocol)


@hookimpl
def register_tools(register: Callable[..., None]) -> None:
    from hf_core.agents.tools import (
        CALCULATOR_PARAMETERS,
        PYTHON_PARAMETERS,
        calculator,
        python,
    )

    register("calculator", calculator, parameters=CALCULATOR_PARAMETERS)
    register("python", python, parameters=PYTHON_PARAMETERS)
