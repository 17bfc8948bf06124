"""Lazy engine factories: loading a plugin must not import its framework.

``hybridflow backends`` and recipe checks load every installed plugin; a backend's framework
(vLLM, SGLang, megatron-core, transformers) is imported only when an engine is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_core.imports import import_object


def engine_factory(path: str) -> Callable[..., Any]:
    """``factory(**config)`` building the engine class at ``"module:Class"`` from its config.

    Every engine class takes its settings as one mapping (validated by its config model).
    """

    def factory(**config: Any) -> Any:
        return import_object(path)(config)

    factory.__doc__ = f"``{path.split(':')[1]}`` from keyword config (imported on first use)."
    factory.__qualname__ = f"engine_factory({path!r})"
    return factory
