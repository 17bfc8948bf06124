"""Retired spellings (issue 58: one meaning per word): the old name is refused, and the message
gives the new one, so code, a plugin or a recipe written against it says what to write instead.

Nothing is kept as an alias: an alias would keep both meanings alive.  ``docs/glossary.md``
lists the renames and what each word means now.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NoReturn

from hf_core.errors import RenamedError

HF_MEANS_HYBRIDFLOW = "'hf' means HybridFlow, not Hugging Face"
"""Why the transformers engine's classes and the saved-``datasets`` format lost their ``hf``."""


def renamed(what: str, old: str, new: str, why: str = "") -> str:
    """The one wording of a refused old spelling: ``format 'hf' was renamed 'datasets'``."""
    return f"{what} {old!r} was renamed {new!r}" + (f" ({why})" if why else "")


def renamed_attributes(
    module: str, renames: Mapping[str, str], why: str = ""
) -> Callable[[str], NoReturn]:
    """A module-level ``__getattr__`` for ``module`` refusing each old attribute name in
    ``renames`` (old -> new) with :class:`~hf_core.errors.RenamedError`; any other missing
    name is the usual ``AttributeError``.

    Define it under ``if not TYPE_CHECKING:``, so type checkers keep flagging unknown names.
    """

    def __getattr__(name: str) -> NoReturn:
        new = renames.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise RenamedError(module=module, old=name, new=new, why=why)

    return __getattr__
