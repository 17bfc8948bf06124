"""One name -> value table for everything HybridFlow looks up by name.

Algorithms, reward functions, engines, engine configs and transfer protocols are all named
in YAML and registered by built-ins or plugins.  They share this table so each gets the same
behaviour: a taken name is an error that names both owners, and a lookup miss lists every
registered name with the closest match, so a typo in a config fails at start-up with the fix
in the message.

A name can be *declared* before it is registered (:meth:`NamedRegistry.declare`): the module
that registers it is imported on its first lookup.  Built-ins whose modules import torch are
declared so, which lets a recipe's names be checked (and listed) without importing torch.
"""

from __future__ import annotations

import copy
import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A name was looked up in a registry that does not hold it.

    A :class:`KeyError` (so ``except KeyError`` still works) whose text is the plain message
    rather than KeyError's quoted repr.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateNameError(ValueError):
    """Two registrations claimed the same name."""


class NamedRegistry(Generic[T]):
    """Name -> value for one kind of thing (e.g. "advantage estimator"), with owners.

    ``miss_error`` is the :class:`UnknownNameError` subclass a failed lookup raises, and
    ``miss_hint`` text appended to its message (e.g. how else the value can be given).
    """

    def __init__(
        self,
        kind: str,
        *,
        miss_error: type[UnknownNameError] = UnknownNameError,
        miss_hint: str = "",
    ) -> None:
        self.kind = kind
        self._values: dict[str, T] = {}
        self._owners: dict[str, str] = {}
        self._miss_error = miss_error
        self._miss_hint = miss_hint
        self._loader: Callable[[], None] | None = None
        self._note: Callable[[], str] | None = None
        self._declared: dict[str, str] = {}
        """Names registered by importing a module (name -> module), not imported yet."""

    @property
    def miss_error(self) -> type[UnknownNameError]:
        """What a failed lookup raises; a bad import path for this kind raises it too
        (:func:`hf_core.imports.resolve_function`)."""
        return self._miss_error

    def declare(self, module: str, *names: str) -> None:
        """``names`` are registered by importing ``module``: they are listed, taken and found
        now, and ``module`` is imported on the first :meth:`get` of one of them."""
        for name in names:
            if name not in self._values:
                self._declared[name] = module
                self._owners[name] = module

    def declared(self, name: str) -> str | None:
        """The module that will register ``name``, if it is declared and not registered yet."""
        return self._declared.get(name)

    def set_loader(
        self, load: Callable[[], None] | None, note: Callable[[], str] | None = None
    ) -> None:
        """``load()`` runs before a lookup misses and before names are listed, so entries that
        plugins provide are there on first use (the plugin manager installs it: this module
        stays below the plugins); ``note()`` adds to a miss's message (e.g. the plugins that
        failed to load)."""
        self._loader, self._note = load, note

    def _load(self) -> None:
        if self._loader is not None:
            self._loader()

    def add(self, name: str, value: T, *, owner: str = "", override: bool = False) -> T:
        """Register ``value`` as ``name``; a taken name is an error unless ``override`` (a
        name declared for ``value``'s own module is not taken: the module is registering it)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
        own = name in self._declared and self._declared[name] == getattr(value, "__module__", None)
        if name in self and not override and not own:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered by both {self.owner(name)!r} and "
                f"{owner or _describe(value)!r}; pass override=True to replace it"
            )
        self._declared.pop(name, None)
        self._values[name] = value
        self._owners[name] = owner or _describe(value)
        return value

    def _import_declared(self, name: str) -> None:
        """Import the module that registers the declared ``name``; it must register it."""
        module = self._declared.get(name)
        if module is None:
            return
        importlib.import_module(module)
        if name not in self._values:
            raise RuntimeError(f"{module} is declared to register {self.kind} {name!r} but did not")

    def get(self, name: str) -> T:
        """The value registered as ``name`` (a declared one's module imported first);
        ``miss_error`` naming the alternatives if none."""
        try:
            return self._values[name]
        except (KeyError, TypeError):
            pass
        self.require(name)
        self._import_declared(name)
        return self._values[name]

    def require(self, name: str) -> None:
        """Return if ``name`` is registered or declared, else raise ``miss_error`` naming the
        alternatives: a name check that imports no declared module (a recipe check)."""
        if self._holds_name(name):
            return
        available = self.names()  # loads the plugins' entries first
        if self._holds_name(name):
            return
        message = f"unknown {self.kind} {name!r}; available: {', '.join(available) or '(none)'}"
        if self._miss_hint:
            message += f"; {self._miss_hint}"
        note = self._note() if self._note is not None else ""
        if note:
            message += f"; {note}"
        close = difflib.get_close_matches(str(name), available, n=1)
        if close:
            message += f" (did you mean {close[0]!r}?)"
        raise self._miss_error(message)

    def _holds_name(self, name: object) -> bool:
        try:
            return name in self._values or name in self._declared
        except TypeError:  # unhashable: never a name
            return False

    def owner(self, name: str) -> str:
        """Who registered ``name`` (a plugin name, or the value's qualified name)."""
        return self._owners[name]

    def names(self) -> list[str]:
        """Every registered name (aliases included), sorted."""
        self._load()
        return sorted({*self._values, *self._declared})

    def items(self) -> list[tuple[str, T]]:
        """Every entry, declared ones imported first."""
        return [(name, self.get(name)) for name in self.names()]

    def holds(self, name: str, value: T) -> bool:
        """Whether ``name`` is registered as this very ``value`` (a plugin registering again
        after :func:`hf_core.plugins.reset` is not a conflict)."""
        return name in self._values and self._values[name] is value

    def copy(self) -> NamedRegistry[T]:
        """An independent table with the same entries (tests register into a copy)."""
        twin = copy.copy(self)  # keeps the subclass and its settings
        twin._values, twin._owners = dict(self._values), dict(self._owners)
        twin._declared = dict(self._declared)
        return twin

    def remove(self, name: str) -> None:
        """Forget ``name`` (the plugin manager forgets a plugin's entries when it resets)."""
        self._values.pop(name, None)
        self._owners.pop(name, None)
        self._declared.pop(name, None)

    def clear(self) -> None:
        self._values.clear()
        self._owners.clear()
        self._declared.clear()

    def __contains__(self, name: object) -> bool:
        return self._holds_name(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._values) + len(self._declared)

    def __repr__(self) -> str:
        return f"NamedRegistry({self.kind!r}, {self.names()})"


def _describe(value: object) -> str:
    module = getattr(value, "__module__", None)
    name = getattr(value, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(value)
