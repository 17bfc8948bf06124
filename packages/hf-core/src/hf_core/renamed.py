"""Retired spellings (issue 58: one meaning per word): the old name is refused, and the message
gives the new one, so code, a plugin or a recipe written against it says what to write instead.

Nothing is kept as an alias: an alias would keep both meanings alive.  ``docs/glossary.md``
lists the renames and what each word means now.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hf_core.errors import RenamedError

HF_MEANS_HYBRIDFLOW = "'hf' means HybridFlow, not Hugging Face"
"""Why the transformers engine's classes and the saved-``datasets`` format lost their ``hf``."""
POOL_MEANS_RESOURCES = (
    "'pool' means a resource pool; a host's first rank training for its ranks is their leader"
)
"""Why the FSDP engine's CPU strategy where one rank trains for its host's ranks lost ``pool``."""
THE_LEADER = "a host's first rank computing for its ranks is its leader (cpu_data_parallel: leader)"
"""Why the transformers engine's decoding on that rank lost ``cpu_host`` for ``cpu_leader``."""
PLAN_MEANS_PLACEMENT = "'plan' means the placement plan the auto-mapping planner makes"
"""Why other things called a plan were renamed (the reshard plan keeps its compound name)."""


def renamed(what: str, old: str, new: str, why: str = "") -> str:
    """The one wording of a refused old spelling: ``format 'hf' was renamed 'datasets'``."""
    return f"{what} {old!r} was renamed {new!r}" + (f" ({why})" if why else "")


def refuse_renamed_keys(data: object, renames: Mapping[str, str], why: str = "") -> None:
    """For a pydantic ``model_validator(mode="before")``: a retired key in the mapping
    ``data`` raises ``ValueError`` naming the new key (pydantic reports it as the model's
    error, before ``extra="forbid"`` would call the key merely unknown)."""
    if isinstance(data, Mapping):
        for old, new in renames.items():
            if old in data:
                raise ValueError(renamed("key", old, new, why))


def refuse_renamed_value(
    value: object, renames: Mapping[str, str], what: str, why: str = ""
) -> None:
    """For a pydantic ``field_validator(mode="before")``: a retired value raises
    ``ValueError`` naming the new one (before the field's ``Literal`` lists the choices)."""
    if isinstance(value, str) and value in renames:
        raise ValueError(renamed(what, value, renames[value], why))


def renamed_attributes(
    module: str,
    renames: Mapping[str, str],
    why: str = "",
    fallback: Callable[[str], Any] | None = None,
) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` refusing each old attribute name in
    ``renames`` (old -> new) with :class:`~hf_core.errors.RenamedError`; any other missing
    name goes to ``fallback`` (a lazy package's own ``__getattr__``), else is the usual
    ``AttributeError``.

    Define it under ``if not TYPE_CHECKING:``, so type checkers keep flagging unknown names.
    """

    def __getattr__(name: str) -> Any:
        new = renames.get(name)
        if new is not None:
            raise RenamedError(module=module, old=name, new=new, why=why)
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
