"""Name -> function registries for the RL building blocks (one registry per kind).

Recipes and YAML name an algorithm ("gae", "grpo", "dual_clip", "k3", "token-mean"); the trainer
looks the name up here instead of growing an ``if``/``elif`` ladder, and a plugin adds its own
estimator, loss, KL estimator or aggregation mode through its plugin hook
(:mod:`hf_core.plugins.hookspecs`), which fills the same tables.  A lookup miss raises
:class:`UnknownAlgorithmError` listing every registered name (and the closest match), so a typo in
a config fails at start-up with the fix in the message.

Advantage estimators are registered with :class:`EstimatorTraits` -- what the dataflow around
them must provide (a critic, groups of samples, a greedy baseline).  Config validation, the
trainer's stages and the planner's dataflow read the traits, so no estimator name is
hard-coded outside this registry.

This module imports nothing from its siblings: the built-ins register themselves when
``hf_core.algorithms`` imports its submodules, which is the package's only import-time effect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from hf_core.registry import NamedRegistry, UnknownNameError

if TYPE_CHECKING:
    import torch

F = TypeVar("F", bound=Callable[..., Any])
Fn = TypeVar("Fn", bound=Callable[..., Any])

#: ``(token_level_rewards, response_mask, **inputs) -> (advantages, returns)``, both [B, T].
AdvantageEstimator = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
#: ``(log_prob, old_log_prob, advantages, response_mask, config=None, **group)``
#: ``-> (loss, metrics)``.
PolicyLoss = Callable[..., "tuple[torch.Tensor, dict[str, float]]"]
#: ``(log_prob, ref_log_prob) -> per-token KL estimate`` (same shape as the inputs).
KLEstimator = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
#: ``(loss_mat, mask, *, group_ids=None, norm_length=None) -> scalar loss``.
AggregationFn = Callable[..., "torch.Tensor"]


class UnknownAlgorithmError(UnknownNameError):
    """A name was looked up in an algorithm registry that does not hold it."""


@dataclass(frozen=True)
class EstimatorTraits:
    """What an advantage estimator needs from the dataflow around it."""

    needs_critic: bool = False
    """Uses per-token ``values`` from a critic (GAE): the run must have a critic role."""
    needs_groups: bool = False
    """Compares the ``n`` samples of one prompt: ``rollout.n`` must be at least 2."""
    needs_greedy_baseline: bool = False
    """Takes the reward of one extra greedy response per prompt as its baseline (ReMax)."""


class Registry(NamedRegistry[F]):
    """A name -> function table for one kind of building block (e.g. "advantage estimator")."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind, miss_error=UnknownAlgorithmError)

    def register(self, *names: str, override: bool = False) -> Callable[[Fn], Fn]:
        """Decorator registering the function under every name in ``names`` (aliases allowed).

        Registering a taken name is an error unless ``override=True``, so two plugins cannot
        silently shadow each other; a name declared for the function's own module (a
        built-in, :meth:`~hf_core.registry.NamedRegistry.declare`) is not taken.
        """
        if not names:
            raise ValueError(f"register a {self.kind} under at least one name")

        def decorator(fn: Fn) -> Fn:
            for name in names:
                own = self.declared(name) == getattr(fn, "__module__", None)
                if name in self and not override and not own:
                    raise ValueError(
                        f"{self.kind} {name!r} is already registered (by {self.owner(name)}); "
                        "pass override=True to replace it"
                    )
            for name in names:
                self.add(name, cast(F, fn), override=True)
            return fn

        return decorator


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
ESTIMATOR_TRAITS: NamedRegistry[EstimatorTraits] = NamedRegistry(
    "advantage estimator", miss_error=UnknownAlgorithmError
)
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
AGGREGATION_MODES: Registry[AggregationFn] = Registry("loss aggregation mode")


def advantage_estimator(
    *names: str,
    needs_critic: bool = False,
    needs_groups: bool = False,
    needs_greedy_baseline: bool = False,
    override: bool = False,
) -> Callable[[Fn], Fn]:
    """Register an advantage estimator and its traits: ``@advantage_estimator("gae",
    needs_critic=True)``."""
    register = ADVANTAGE_ESTIMATORS.register(*names, override=override)
    traits = EstimatorTraits(needs_critic, needs_groups, needs_greedy_baseline)

    def decorator(fn: Fn) -> Fn:
        for name in names:
            ESTIMATOR_TRAITS.add(name, traits, override=True)
        return register(fn)

    return decorator


def add_advantage_estimator(
    name: str, fn: AdvantageEstimator, traits: EstimatorTraits, *, owner: str
) -> None:
    """Register one estimator and its traits for ``owner`` (a plugin's ``register``)."""
    if ADVANTAGE_ESTIMATORS.holds(name, fn):
        return
    ADVANTAGE_ESTIMATORS.add(name, fn, owner=owner)
    ESTIMATOR_TRAITS.add(name, traits, owner=owner, override=True)


def add_policy_loss(name: str, fn: PolicyLoss, *, owner: str) -> None:
    """Register one policy loss for ``owner`` (a plugin's ``register``)."""
    if not POLICY_LOSSES.holds(name, fn):
        POLICY_LOSSES.add(name, fn, owner=owner)


def add_kl_estimator(name: str, fn: KLEstimator, *, owner: str) -> None:
    """Register one KL estimator for ``owner`` (a plugin's ``register``)."""
    if not KL_ESTIMATORS.holds(name, fn):
        KL_ESTIMATORS.add(name, fn, owner=owner)


def add_aggregation_mode(name: str, fn: AggregationFn, *, owner: str) -> None:
    """Register one loss aggregation mode for ``owner`` (a plugin's ``register``)."""
    if not AGGREGATION_MODES.holds(name, fn):
        AGGREGATION_MODES.add(name, fn, owner=owner)


def policy_loss(*names: str, override: bool = False) -> Callable[[Fn], Fn]:
    """Register a policy loss: ``@policy_loss("ppo_clip")``."""
    return POLICY_LOSSES.register(*names, override=override)


def kl_estimator(*names: str, override: bool = False) -> Callable[[Fn], Fn]:
    """Register a per-token KL estimator: ``@kl_estimator("k3")``."""
    return KL_ESTIMATORS.register(*names, override=override)


def aggregation_mode(*names: str, override: bool = False) -> Callable[[Fn], Fn]:
    """Register a loss aggregation mode: ``@aggregation_mode("token-mean")``."""
    return AGGREGATION_MODES.register(*names, override=override)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The advantage estimator registered as ``name``."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_estimator_traits(name: str) -> EstimatorTraits:
    """What the advantage estimator registered as ``name`` needs (critic, groups, baseline)."""
    return ESTIMATOR_TRAITS.get(name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``."""
    return POLICY_LOSSES.get(name)


def get_kl_estimator(name: str) -> KLEstimator:
    """The KL estimator registered as ``name``."""
    return KL_ESTIMATORS.get(name)


def get_aggregation_mode(name: str) -> AggregationFn:
    """The loss aggregation function registered as ``name``."""
    return AGGREGATION_MODES.get(name)
