"""Package namespaces that import their submodules on first use.

``hybridflow --help`` and the recipe checks before a run need the config, the registries and
a few file checks; the packages they live in also hold the engines, role workers and the
trainer, which import torch (and tensordict, Ray).  A package whose ``__init__`` re-exports
those names through :func:`lazy_exports` keeps ``from hf_core.roles import X`` working while
importing ``hf_core.roles.common`` stays as light as that module.  The names are imported
statically under ``TYPE_CHECKING`` as well, so type checkers see the real types.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(
    package: str, submodules: Mapping[str, Iterable[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``submodules`` maps each submodule
    (relative, e.g. ``"rl"`` for ``package.rl``) to the public names it defines.

    An attribute that is not an export but names a submodule imports it, as it would have
    been after an eager ``__init__``; the value is cached in the package's namespace.
    """
    exports = {name: module for module, names in submodules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = importlib.import_module(package)
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        elif not name.startswith("__"):
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise  # the submodule exists and failed inside
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *exports})

    return __getattr__, __dir__
