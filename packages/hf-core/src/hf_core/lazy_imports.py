"""Package namespaces that import their submodules on first use.

``hybridflow --help`` and the recipe checks before a run need the config, the registries and
a few file checks; the packages they live in also hold the engines, role workers and the
trainer, which import torch (and tensordict, Ray).  A package whose ``__init__`` re-exports
those names through :func:`lazy_exports` keeps ``from hf_core.roles import X`` working while
importing ``hf_core.roles.common`` stays as light as that module.  The names are imported
statically under ``TYPE_CHECKING`` as well, so type checkers see the real types.

:func:`lazy_package` reads those typed imports back as the table, so a package lists each
export once: ``from pkg.module import Name as Name`` (the explicit re-export that type
checkers of a ``py.typed`` package honour), under ``if TYPE_CHECKING:`` for a lazy name.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
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


def reexported_names(package: str, source: str) -> dict[str, str]:
    """Each name the ``__init__`` ``source`` of ``package`` re-exports, with its submodule
    (relative): every top-level ``from package.module import Name as Name``, eager or under
    ``if TYPE_CHECKING:``.  Other imports (a plain ``Name``, another package's) stay private.
    """
    statements: list[ast.stmt] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            statements += node.body
        else:
            statements.append(node)
    prefix, found = f"{package}.", {}
    for stmt in statements:
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith(prefix):
            module = str(stmt.module).removeprefix(prefix)
            found.update({alias.name: module for alias in stmt.names if alias.asname == alias.name})
    return found


def reexports(package: str) -> dict[str, str]:
    """:func:`reexported_names` of ``package``'s ``__init__``, read from its source (called
    from that ``__init__``; parsed once, at that import, as ``lazy_loader.attach_stub`` reads a
    stub: well under a millisecond).  An eager package's ``__all__`` is their names."""
    spec = importlib.util.find_spec(package)
    get_source = getattr(spec and spec.loader, "get_source", None)
    source = get_source(package) if get_source else None
    if source is None:
        raise ImportError(f"{package}: its re-exports are read from the source of its __init__")
    return reexported_names(package, source)


def lazy_package(
    package: str,
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``, from the re-exports its
    ``__init__`` spells (:func:`reexports`): the typed imports are the one list, so ``__all__``
    and the runtime table cannot drift from what type checkers see."""
    names = reexports(package)
    by_module: dict[str, list[str]] = {}
    for name, module in names.items():
        by_module.setdefault(module, []).append(name)
    return sorted(names), *lazy_exports(package, by_module)
