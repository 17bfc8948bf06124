"""Name -> function registries for the RL building blocks (one registry per kind).

Recipes and YAML name an algorithm ("gae", "grpo", "dual_clip", "k3", "token-mean"); the trainer
looks the name up here instead of growing an ``if``/``elif`` ladder, and a plugin adds its own
estimator or loss with the same decorator the built-ins use.  A lookup miss raises
:class:`UnknownAlgorithmError` listing every registered name (and the closest match), so a typo in
a config fails at start-up with the fix in the message.

This module imports nothing from its siblings: the built-ins register themselves when
``hf_core.algorithms`` imports its submodules, which is the package's only import-time effect.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

F = TypeVar("F", bound=Callable[..., Any])

#: ``(token_level_rewards, response_mask, **inputs) -> (advantages, returns)``, both [B, T].
AdvantageEstimator = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
#: ``(log_prob, old_log_prob, advantages, response_mask, config=None, **group)``
#: ``-> (loss, metrics)``.
PolicyLoss = Callable[..., "tuple[torch.Tensor, dict[str, float]]"]
#: ``(log_prob, ref_log_prob) -> per-token KL estimate`` (same shape as the inputs).
KLEstimator = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
#: ``(loss_mat, mask, *, group_ids=None, norm_length=None) -> scalar loss``.
AggregationFn = Callable[..., "torch.Tensor"]


class UnknownAlgorithmError(KeyError):
    """A name was looked up in a registry that does not hold it.

    A :class:`KeyError` (so ``except KeyError`` still works) whose text is the plain message
    rather than KeyError's quoted repr.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Generic[F]):
    """A name -> function table for one kind of building block (e.g. "advantage estimator")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, *names: str, override: bool = False) -> Callable[[F], F]:
        """Decorator registering the function under every name in ``names`` (aliases allowed).

        Registering a taken name is an error unless ``override=True``, so two plugins cannot
        silently shadow each other.
        """
        if not names:
            raise ValueError(f"register a {self.kind} under at least one name")
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
            if name in self._entries and not override:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered "
                    f"(by {self._entries[name].__qualname__}); pass override=True to replace it"
                )

        def decorator(fn: F) -> F:
            for name in names:
                self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; :class:`UnknownAlgorithmError` if none is."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            pass
        available = self.names()
        message = f"unknown {self.kind} {name!r}; available: {', '.join(available) or '(none)'}"
        close = difflib.get_close_matches(str(name), available, n=1)
        if close:
            message += f" (did you mean {close[0]!r}?)"
        raise UnknownAlgorithmError(message)

    def names(self) -> list[str]:
        """Every registered name (aliases included), sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
AGGREGATION_MODES: Registry[AggregationFn] = Registry("loss aggregation mode")


def advantage_estimator(*names: str, override: bool = False) -> Callable[[F], F]:
    """Register an advantage estimator: ``@advantage_estimator("gae")``."""
    return ADVANTAGE_ESTIMATORS.register(*names, override=override)


def policy_loss(*names: str, override: bool = False) -> Callable[[F], F]:
    """Register a policy loss: ``@policy_loss("ppo_clip")``."""
    return POLICY_LOSSES.register(*names, override=override)


def kl_estimator(*names: str, override: bool = False) -> Callable[[F], F]:
    """Register a per-token KL estimator: ``@kl_estimator("k3")``."""
    return KL_ESTIMATORS.register(*names, override=override)


def aggregation_mode(*names: str, override: bool = False) -> Callable[[F], F]:
    """Register a loss aggregation mode: ``@aggregation_mode("token-mean")``."""
    return AGGREGATION_MODES.register(*names, override=override)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The advantage estimator registered as ``name``."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``."""
    return POLICY_LOSSES.get(name)


def get_kl_estimator(name: str) -> KLEstimator:
    """The KL estimator registered as ``name``."""
    return KL_ESTIMATORS.get(name)


def get_aggregation_mode(name: str) -> AggregationFn:
    """The loss aggregation function registered as ``name``."""
    return AGGREGATION_MODES.get(name)
