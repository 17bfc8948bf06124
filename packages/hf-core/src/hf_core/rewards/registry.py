"""Rule-based reward functions, referenced by registered name or by import path.

The batched signature every reward function has (after registration)::

    fn(responses: list[str], ground_truths: list[Any], extras: dict[str, list]) -> list[float]

``responses[i]`` is the decoded response of sample ``i`` (special tokens skipped),
``ground_truths[i]`` its reference answer (``None`` when the dataset has none) and
``extras[key][i]`` every other per-sample value the batch carries (``raw_prompt``,
``sample_index`` and the dataset's extra fields).  It returns one finite float per sample.

Register with the decorator; ``batched=False`` registers a per-sample function
``fn(response, ground_truth, extra: dict) -> float`` (the decorator returns it unchanged and
registers a batched adapter)::

    @reward_function("digits_reverse")
    def digits_reverse(responses, ground_truths, extras): ...

    @reward_function("contains_answer", batched=False)
    def contains_answer(response, ground_truth, extra): ...

A config names a function as ``"digits_reverse"`` (the registry) or ``"my_pkg.rewards:score"``
(imported; a function decorated there with ``batched=False`` keeps its adapter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hf_core.imports import resolve_function
from hf_core.registry import NamedRegistry, UnknownNameError

BatchedRewardFn = Callable[[list[str], list[Any], dict[str, list[Any]]], Sequence[float]]
PerSampleRewardFn = Callable[[str, Any, dict[str, Any]], float]

_ATTR = "__hf_reward_function__"


class UnknownRewardFunctionError(UnknownNameError):
    """A reward function name or import path did not resolve (the message says why)."""


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward function: its name and its batched callable."""

    name: str
    fn: BatchedRewardFn
    batched: bool = True

    def __call__(
        self, responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
    ) -> Sequence[float]:
        return self.fn(responses, ground_truths, extras)


def _per_sample_adapter(fn: PerSampleRewardFn) -> BatchedRewardFn:
    def batched(
        responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
    ) -> list[float]:
        return [
            fn(response, truth, {k: v[i] for k, v in extras.items()})
            for i, (response, truth) in enumerate(zip(responses, ground_truths, strict=True))
        ]

    batched.__name__ = getattr(fn, "__name__", "reward")
    batched.__qualname__ = getattr(fn, "__qualname__", batched.__name__)
    batched.__module__ = getattr(fn, "__module__", batched.__module__)
    return batched


REWARD_FUNCTIONS: NamedRegistry[RewardFunction] = NamedRegistry(
    "reward function",
    miss_error=UnknownRewardFunctionError,
    miss_hint="or give an import path 'package.module:function'",
)


def reward_function(
    name: str | None = None, *, batched: bool = True, override: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering a reward function under ``name`` (default: the function's name).

    Registering a taken name is an error unless ``override=True`` (or it is the same function
    re-registered, as happens when its module is reloaded).
    """

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        key = name or fn.__name__
        if not isinstance(key, str) or not key:
            raise ValueError(f"reward function names must be non-empty strings, got {key!r}")
        entry = RewardFunction(key, fn if batched else _per_sample_adapter(fn), batched)
        existing = REWARD_FUNCTIONS.get(key) if key in REWARD_FUNCTIONS else None
        same = existing is not None and _qualified(existing.fn) == _qualified(entry.fn)
        if existing is not None and not override and not same:
            raise ValueError(
                f"reward function {key!r} is already registered (by {_qualified(existing.fn)}); "
                "pass override=True to replace it"
            )
        REWARD_FUNCTIONS.add(key, entry, owner=_qualified(entry.fn), override=True)
        setattr(fn, _ATTR, entry)
        return fn

    return decorator


def add_reward_function(name: str, fn: Callable[..., Any], *, batched: bool, owner: str) -> None:
    """Register one reward function for ``owner`` (a plugin's ``register``; ``batched=False``:
    a per-sample function, adapted)."""
    existing = REWARD_FUNCTIONS.get(name) if name in REWARD_FUNCTIONS else None
    if existing is not None and getattr(fn, _ATTR, None) is existing:
        return  # registered again after the plugins were reset
    entry = RewardFunction(name, fn if batched else _per_sample_adapter(fn), batched)
    REWARD_FUNCTIONS.add(name, entry, owner=owner)
    setattr(fn, _ATTR, entry)


def _qualified(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def reward_function_names() -> list[str]:
    """Every registered reward function name, sorted."""
    return REWARD_FUNCTIONS.names()


def get_reward_function(
    spec: str | Callable[..., Any] | RewardFunction, key: str = "reward function"
) -> RewardFunction:
    """Resolve a registered name, a ``"module:function"`` path
    (:func:`hf_core.imports.resolve_function`, errors worded for ``key``) or a callable (taken
    as batched)."""
    if isinstance(spec, RewardFunction):
        return spec
    if callable(spec):
        registered = getattr(spec, _ATTR, None)
        if isinstance(registered, RewardFunction):
            return registered
        return RewardFunction(getattr(spec, "__qualname__", repr(spec)), spec)
    if not isinstance(spec, str):
        raise TypeError(f"a reward function is a name, an import path or a callable, got {spec!r}")
    found = resolve_function(spec, key=key, table=REWARD_FUNCTIONS)
    if not found.imported:
        return found.value
    registered = getattr(found.value, _ATTR, None)
    if isinstance(registered, RewardFunction):  # decorated there: keeps its batch adapter
        return RewardFunction(spec, registered.fn, registered.batched)
    if isinstance(found.value, RewardFunction):
        return found.value
    return RewardFunction(spec, found.value)
