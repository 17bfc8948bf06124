"""The one resolver for what a recipe names: a registered name or ``package.module:attr``.

Reward functions, agent tools, environments, agent functions and engine settings models are
all named this way.  Each loader hands :func:`resolve` its recipe key, its table (if the kind
has one) and what the object must be, so every one fails the same way: an unknown name lists
the registered ones with the closest match (:class:`hf_core.registry.NamedRegistry`); a bad
``module:attr`` says which key, which module and what failed (no such module, the module
raised while importing, no such attribute, a retired spelling with its new name, an object of
the wrong kind).

Below every layer that names things (only the standard library, the registry and the error
types): rewards and agents use it without importing the plugins.
"""

from __future__ import annotations

import difflib
import importlib
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hf_core.errors import ConfigError, RenamedError
from hf_core.registry import NamedRegistry

T = TypeVar("T")

FORM = "'package.module:attr'"


class UnresolvedReference(ConfigError):
    """A ``module:attr`` reference that could not be imported, or is not what its key needs."""


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """What a reference resolved to: ``path`` is the ``module:attr`` it was imported from, or
    empty for a registered ``name``."""

    name: str
    value: T
    path: str = ""

    @property
    def imported(self) -> bool:
        return bool(self.path)


def is_import_path(spec: str) -> bool:
    """Whether ``spec`` is a ``module:attr`` reference (registered names hold no colon)."""
    return ":" in spec


def import_object(spec: str) -> Any:
    """The object ``spec`` names (``attr`` may be dotted: ``module:Class.method``); raises
    ImportError or AttributeError.  For code paths (lazy engine factories) whose reference a
    plugin wrote; what a recipe names goes through :func:`resolve`."""
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve(
    spec: str,
    *,
    key: str,
    table: NamedRegistry[T] | None = None,
    error: Callable[[str], Exception] = UnresolvedReference,
    accept: Callable[[Any], bool] | None = None,
    expected: str = "",
    form: str = FORM,
) -> Resolved[Any]:
    """``spec`` as a registered name in ``table`` or an imported ``module:attr``.

    ``key`` is the recipe key that named it (in every message); ``error`` builds the
    exception a bad path raises (an unknown name raises the table's own miss error);
    ``accept`` / ``expected`` check an imported object ("is a float, not a callable").
    ``form`` shows the expected shape of a path (``'package.module:Class'``).  Without a
    table only paths are accepted.
    """
    if not isinstance(spec, str) or not spec:
        raise error(f"{key}: expected a name or {form}, got {spec!r}")
    if is_import_path(spec):
        value = import_reference(
            spec, key=key, error=error, accept=accept, expected=expected, form=form
        )
        return Resolved(spec.rpartition(":")[2].rpartition(".")[2], value, spec)
    if table is None:
        raise error(f"{key} {spec!r} must look like {form}")
    return Resolved(spec, table.get(spec))


def resolve_function(spec: str, *, key: str, table: NamedRegistry[T]) -> Resolved[Any]:
    """:func:`resolve` for a table of functions (agent tools, reward functions): a registered
    name or any callable at ``package.module:function``; a bad path raises the table's own
    miss error, as an unknown name does."""
    return resolve(
        spec,
        key=key,
        table=table,
        error=table.miss_error,
        accept=callable,
        expected="a callable",
        form="'package.module:function'",
    )


def import_reference(
    spec: str,
    *,
    key: str,
    error: Callable[[str], Exception] = UnresolvedReference,
    accept: Callable[[Any], bool] | None = None,
    expected: str = "",
    form: str = FORM,
) -> Any:
    """The object ``spec`` (``module:attr``) names, every failure worded for ``key``."""
    module_name, _, attr = spec.partition(":")
    if not _dotted(module_name) or not _dotted(attr):
        raise error(f"{key} {spec!r} must look like {form}")
    module = _import_module(spec, module_name, key, error)
    obj: Any = module
    walked = module_name
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except RenamedError as exc:  # a retired spelling: the message names the new one
            if walked != module_name:  # an attribute of a class, not of the module
                raise error(f"{key} {spec!r}: {exc}") from None
            new_spec = spec.replace(f":{part}", f":{exc.new}", 1)
            raise error(f"{key} {spec!r}: {exc.renamed}: write {new_spec!r}") from None
        except AttributeError:
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise error(
                f"{key} {spec!r}: {_kind(obj)} {walked!r} has no attribute {part!r}{hint}"
            ) from None
        walked = f"{walked}.{part}" if walked != module_name else f"{module_name}:{part}"
    if accept is not None and not accept(obj):
        raise error(f"{key} {spec!r} is a {type(obj).__name__}, not {expected or 'usable'}")
    return obj


def _import_module(spec: str, module_name: str, key: str, error: Callable[[str], Exception]) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise error(
                f"{key} {spec!r}: cannot import module {module_name!r}: {exc} (is its "
                "folder on PYTHONPATH, or its distribution installed, where this runs?)"
            ) from exc
        raise error(_raised(spec, module_name, key, exc)) from exc
    except Exception as exc:  # the module itself raised: as much a bad setting as a typo
        raise error(_raised(spec, module_name, key, exc)) from exc


def _raised(spec: str, module_name: str, key: str, exc: BaseException) -> str:
    where = ""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" ({exc.filename}, line {exc.lineno})"
    return (
        f"{key} {spec!r}: cannot import module {module_name!r}: importing it raised "
        f"{type(exc).__name__}: {exc}{where}"
    )


def _dotted(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def _kind(obj: Any) -> str:
    return "module" if isinstance(obj, types.ModuleType) else type(obj).__name__
