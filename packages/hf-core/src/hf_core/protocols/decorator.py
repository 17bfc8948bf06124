"""``@register``: declare how a worker method is dispatched, collected and executed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from hf_core.protocols.transfer import ONE_TO_ALL, TransferProtocol

F = TypeVar("F", bound=Callable[..., Any])
Execute = Literal["all", "rank_zero"]

_SPEC_ATTR = "__hf_transfer__"


@dataclass(frozen=True)
class MethodSpec:
    """How the controller calls one worker method."""

    protocol: str | TransferProtocol
    """A built-in or plugin-registered protocol name, or the protocol itself."""
    execute: Execute | None = None
    """``"rank_zero"`` runs the method on rank 0 alone; ``None`` follows the protocol."""
    blocking: bool = True
    """``False``: the call returns a :class:`hf_core.runtime.GroupFuture` immediately."""

    @property
    def protocol_name(self) -> str:
        return self.protocol if isinstance(self.protocol, str) else self.protocol.name


def register(
    protocol: str | TransferProtocol = ONE_TO_ALL,
    *,
    execute: Execute | None = None,
    blocking: bool = True,
) -> Callable[[F], F]:
    """Mark a :class:`hf_core.worker.Worker` method as callable from the controller.

    Example::

        class Critic(Worker):
            @register("DP_PROTO", blocking=False)
            def compute_values(self, batch: Batch) -> Batch: ...
    """
    if execute not in (None, "all", "rank_zero"):
        raise ValueError(f"execute must be 'all' or 'rank_zero', got {execute!r}")
    spec = MethodSpec(protocol=protocol, execute=execute, blocking=blocking)

    def mark(method: F) -> F:
        setattr(method, _SPEC_ATTR, spec)
        return method

    return mark


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every ``@register``-ed method of a worker class (inherited ones included)."""
    found: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, member in vars(klass).items():
            spec = getattr(member, _SPEC_ATTR, None)
            if isinstance(spec, MethodSpec):
                found[name] = spec
    return found
