"""One name -> value table for everything HybridFlow looks up by name.

Algorithms, reward functions, engines, engine configs and transfer protocols are all named
in YAML and registered by built-ins or plugins.  They share this table so each gets the same
behaviour: a taken name is an error that names both owners, and a lookup miss lists every
registered name with the closest match, so a typo in a config fails at start-up with the fix
in the message.
"""

from __future__ import annotations

import copy
import difflib
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
        """Register ``value`` as ``name``; a taken name is an error unless ``override``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
        if name in self._values and not override:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered by both {self.owner(name)!r} and "
                f"{owner or _describe(value)!r}; pass override=True to replace it"
            )
        self._values[name] = value
        self._owners[name] = owner or _describe(value)
        return value

    def get(self, name: str) -> T:
        """The value registered as ``name``; ``miss_error`` naming the alternatives if none."""
        try:
            return self._values[name]
        except (KeyError, TypeError):
            pass
        available = self.names()  # loads the plugins' entries first
        if name in self._values:
            return self._values[name]
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

    def owner(self, name: str) -> str:
        """Who registered ``name`` (a plugin name, or the value's qualified name)."""
        return self._owners[name]

    def names(self) -> list[str]:
        """Every registered name (aliases included), sorted."""
        self._load()
        return sorted(self._values)

    def items(self) -> list[tuple[str, T]]:
        return [(name, self._values[name]) for name in self.names()]

    def holds(self, name: str, value: T) -> bool:
        """Whether ``name`` is registered as this very ``value`` (a plugin registering again
        after :func:`hf_core.plugins.reset` is not a conflict)."""
        return name in self._values and self._values[name] is value

    def copy(self) -> NamedRegistry[T]:
        """An independent table with the same entries (tests register into a copy)."""
        twin = copy.copy(self)  # keeps the subclass and its settings
        twin._values, twin._owners = dict(self._values), dict(self._owners)
        return twin

    def remove(self, name: str) -> None:
        """Forget ``name`` (the plugin manager forgets a plugin's entries when it resets)."""
        self._values.pop(name, None)
        self._owners.pop(name, None)

    def clear(self) -> None:
        self._values.clear()
        self._owners.clear()

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"NamedRegistry({self.kind!r}, {self.names()})"


def _describe(value: object) -> str:
    module = getattr(value, "__module__", None)
    name = getattr(value, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(value)
