"""RL algorithms as pure tensor functions, each registered by name.

Per-token tensors are [B, T] over response tokens with a ``response_mask`` [B, T]; scores are
per sequence [B]; GRPO/RLOO groups are consecutive samples (``Batch.repeat_interleave``) named by
a group size or a per-sample group id.  Nothing here touches Ray, a worker or a backend: the
driver calls these on gathered tensors, workers call the losses inside their train step.

Importing this package declares the built-ins' names (its only side effect): each module
registers its own when it is imported, which the first lookup of one of its names does, so a
recipe's names are checked (and listed) without importing torch.  The built-ins:

* advantage estimators — ``gae``, ``grpo``, ``dr_grpo``, ``rloo``, ``remax``,
  ``reinforce_plus_plus`` (``reinforce++``), ``reinforce_plus_plus_baseline``
  (``reinforce++_baseline``);
* policy losses — ``ppo_clip`` (``vanilla``), ``dual_clip``, ``cispo``, ``gspo``,
  ``gspo_token``;
* KL estimators — ``k1`` (``kl``), ``k2`` (``mse``), ``k3`` (``low_var_kl``), ``abs``;
* aggregation modes — ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
  ``seq-mean-token-sum-norm``, ``group-mean-token-mean``.

Reward shaping that is not a registry entry: ``overlong_penalty`` (DAPO's soft overlong
punishment).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_core.algorithms.registry import ADVANTAGE_ESTIMATORS as ADVANTAGE_ESTIMATORS
from hf_core.algorithms.registry import AGGREGATION_MODES as AGGREGATION_MODES
from hf_core.algorithms.registry import ESTIMATOR_TRAITS as ESTIMATOR_TRAITS
from hf_core.algorithms.registry import KL_ESTIMATORS as KL_ESTIMATORS
from hf_core.algorithms.registry import POLICY_LOSSES as POLICY_LOSSES
from hf_core.algorithms.registry import EstimatorTraits as EstimatorTraits
from hf_core.lazy_imports import lazy_package

if TYPE_CHECKING:
    from hf_core.algorithms.advantages import broadcast_to_tokens as broadcast_to_tokens
    from hf_core.algorithms.advantages import compute_advantage as compute_advantage
    from hf_core.algorithms.advantages import dr_grpo_advantage as dr_grpo_advantage
    from hf_core.algorithms.advantages import gae_advantage as gae_advantage
    from hf_core.algorithms.advantages import group_normalized_scores as group_normalized_scores
    from hf_core.algorithms.advantages import grpo_advantage as grpo_advantage
    from hf_core.algorithms.advantages import leave_one_out_scores as leave_one_out_scores
    from hf_core.algorithms.advantages import (
        reinforce_plus_plus_advantage as reinforce_plus_plus_advantage,
    )
    from hf_core.algorithms.advantages import (
        reinforce_plus_plus_baseline_advantage as reinforce_plus_plus_baseline_advantage,
    )
    from hf_core.algorithms.advantages import remax_advantage as remax_advantage
    from hf_core.algorithms.advantages import rloo_advantage as rloo_advantage
    from hf_core.algorithms.advantages import sequence_scores as sequence_scores
    from hf_core.algorithms.aggregation import aggregate_loss as aggregate_loss
    from hf_core.algorithms.chunked_head import (
        chunked_head_log_probs_and_entropy as chunked_head_log_probs_and_entropy,
    )
    from hf_core.algorithms.groups import group_ids as group_ids
    from hf_core.algorithms.kl import AdaptiveKLController as AdaptiveKLController
    from hf_core.algorithms.kl import FixedKLController as FixedKLController
    from hf_core.algorithms.kl import KLController as KLController
    from hf_core.algorithms.kl import apply_kl_penalty as apply_kl_penalty
    from hf_core.algorithms.kl import kl_abs as kl_abs
    from hf_core.algorithms.kl import kl_k1 as kl_k1
    from hf_core.algorithms.kl import kl_k2 as kl_k2
    from hf_core.algorithms.kl import kl_k3 as kl_k3
    from hf_core.algorithms.kl import kl_penalty as kl_penalty
    from hf_core.algorithms.kl import last_valid_index as last_valid_index
    from hf_core.algorithms.kl import make_kl_controller as make_kl_controller
    from hf_core.algorithms.kl import token_level_rewards as token_level_rewards
    from hf_core.algorithms.losses import PolicyLossConfig as PolicyLossConfig
    from hf_core.algorithms.losses import cispo_loss as cispo_loss
    from hf_core.algorithms.losses import dual_clip_ppo_loss as dual_clip_ppo_loss
    from hf_core.algorithms.losses import entropy_bonus as entropy_bonus
    from hf_core.algorithms.losses import entropy_from_logits as entropy_from_logits
    from hf_core.algorithms.losses import kl_loss as kl_loss
    from hf_core.algorithms.losses import ppo_clip_loss as ppo_clip_loss
    from hf_core.algorithms.losses import value_loss as value_loss
    from hf_core.algorithms.masked import masked_mean as masked_mean
    from hf_core.algorithms.masked import masked_sum as masked_sum
    from hf_core.algorithms.masked import masked_var as masked_var
    from hf_core.algorithms.masked import masked_whiten as masked_whiten
    from hf_core.algorithms.overlong import overlong_penalty as overlong_penalty
    from hf_core.algorithms.overlong import truncated_responses as truncated_responses
    from hf_core.algorithms.preference import DPO_LOSS_TYPES as DPO_LOSS_TYPES
    from hf_core.algorithms.preference import PREFERENCE_LOSSES as PREFERENCE_LOSSES
    from hf_core.algorithms.preference import DPOLossType as DPOLossType
    from hf_core.algorithms.preference import bradley_terry_loss as bradley_terry_loss
    from hf_core.algorithms.preference import dpo_log_ratio_margin as dpo_log_ratio_margin
    from hf_core.algorithms.preference import dpo_loss as dpo_loss
    from hf_core.algorithms.preference import dpo_metrics as dpo_metrics
    from hf_core.algorithms.preference import pair_metrics as pair_metrics
    from hf_core.algorithms.registry import Registry as Registry
    from hf_core.algorithms.registry import UnknownAlgorithmError as UnknownAlgorithmError
    from hf_core.algorithms.registry import advantage_estimator as advantage_estimator
    from hf_core.algorithms.registry import aggregation_mode as aggregation_mode
    from hf_core.algorithms.registry import get_advantage_estimator as get_advantage_estimator
    from hf_core.algorithms.registry import get_aggregation_mode as get_aggregation_mode
    from hf_core.algorithms.registry import get_estimator_traits as get_estimator_traits
    from hf_core.algorithms.registry import get_kl_estimator as get_kl_estimator
    from hf_core.algorithms.registry import get_policy_loss as get_policy_loss
    from hf_core.algorithms.registry import kl_estimator as kl_estimator
    from hf_core.algorithms.registry import policy_loss as policy_loss
    from hf_core.algorithms.safe_rlhf import LagrangeMultiplier as LagrangeMultiplier
    from hf_core.algorithms.safe_rlhf import safe_rlhf_advantage as safe_rlhf_advantage
    from hf_core.algorithms.sequence_losses import gspo_loss as gspo_loss
    from hf_core.algorithms.sequence_losses import gspo_token_loss as gspo_token_loss
    from hf_core.algorithms.sequence_losses import sequence_log_ratio as sequence_log_ratio
    from hf_core.algorithms.token_log_probs import (
        token_log_probs_and_entropy as token_log_probs_and_entropy,
    )
# The re-exports above; the typed ones load on first use (hf_core.lazy_imports).
__all__, __getattr__, __dir__ = lazy_package(__name__)


BUILTIN_ESTIMATOR_TRAITS = {
    "gae": EstimatorTraits(needs_critic=True),
    "grpo": EstimatorTraits(needs_groups=True),
    "dr_grpo": EstimatorTraits(needs_groups=True),
    "rloo": EstimatorTraits(needs_groups=True),
    "remax": EstimatorTraits(needs_greedy_baseline=True),
    "reinforce_plus_plus": EstimatorTraits(),
    "reinforce++": EstimatorTraits(),
    "reinforce_plus_plus_baseline": EstimatorTraits(),
    "reinforce++_baseline": EstimatorTraits(),
}
"""What each built-in estimator needs, known before :mod:`.advantages` (torch) is imported;
its decorators register the same traits (a test holds the two equal)."""


def _declare_builtins() -> None:
    """Every built-in name, registered by its module on first use (see the docstring)."""
    advantages = f"{__name__}.advantages"
    ADVANTAGE_ESTIMATORS.declare(advantages, *BUILTIN_ESTIMATOR_TRAITS)
    for name, traits in BUILTIN_ESTIMATOR_TRAITS.items():
        ESTIMATOR_TRAITS.add(name, traits, owner=advantages)
    POLICY_LOSSES.declare(f"{__name__}.losses", "ppo_clip", "vanilla", "dual_clip", "cispo")
    POLICY_LOSSES.declare(f"{__name__}.sequence_losses", "gspo", "gspo_token")
    KL_ESTIMATORS.declare(f"{__name__}.kl", "k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
    AGGREGATION_MODES.declare(
        f"{__name__}.aggregation",
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "group-mean-token-mean",
    )


_declare_builtins()
