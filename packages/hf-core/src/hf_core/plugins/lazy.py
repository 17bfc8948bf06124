"""Lazy imports for backend packages: loading a plugin must not import its framework.

``hybridflow backends`` and recipe checks load every installed plugin; a backend's framework
(vLLM, SGLang, megatron-core, transformers) is imported only when an engine is built, or when
one of the package's public names is first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def import_object(path: str) -> Any:
    """The object at ``"package.module:Name"``."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` resolving ``name -> "module"`` on first use (PEP 562)."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def engine_factory(path: str) -> Callable[..., Any]:
    """``factory(**config)`` building the engine class at ``"module:Class"`` from its config.

    Every engine class takes its settings as one mapping (validated by its config model).
    """

    def factory(**config: Any) -> Any:
        return import_object(path)(config)

    factory.__doc__ = f"``{path.split(':')[1]}`` from keyword config (imported on first use)."
    factory.__qualname__ = f"engine_factory({path!r})"
    return factory
