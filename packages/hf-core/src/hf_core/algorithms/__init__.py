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

from hf_core.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    ESTIMATOR_TRAITS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    EstimatorTraits,
)
from hf_core.lazy_imports import lazy_exports

if TYPE_CHECKING:
    from hf_core.algorithms.advantages import (
        broadcast_to_tokens,
        compute_advantage,
        dr_grpo_advantage,
        gae_advantage,
        group_normalized_scores,
        grpo_advantage,
        leave_one_out_scores,
        reinforce_plus_plus_advantage,
        reinforce_plus_plus_baseline_advantage,
        remax_advantage,
        rloo_advantage,
        sequence_scores,
    )
    from hf_core.algorithms.aggregation import aggregate_loss
    from hf_core.algorithms.chunked_head import chunked_head_log_probs_and_entropy
    from hf_core.algorithms.groups import group_ids
    from hf_core.algorithms.kl import (
        AdaptiveKLController,
        FixedKLController,
        KLController,
        apply_kl_penalty,
        kl_abs,
        kl_k1,
        kl_k2,
        kl_k3,
        kl_penalty,
        last_valid_index,
        make_kl_controller,
        token_level_rewards,
    )
    from hf_core.algorithms.losses import (
        PolicyLossConfig,
        cispo_loss,
        dual_clip_ppo_loss,
        entropy_bonus,
        entropy_from_logits,
        kl_loss,
        ppo_clip_loss,
        value_loss,
    )
    from hf_core.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
    from hf_core.algorithms.overlong import overlong_penalty, truncated_responses
    from hf_core.algorithms.registry import (
        ADVANTAGE_ESTIMATORS,
        AGGREGATION_MODES,
        ESTIMATOR_TRAITS,
        KL_ESTIMATORS,
        POLICY_LOSSES,
        EstimatorTraits,
        Registry,
        UnknownAlgorithmError,
        advantage_estimator,
        aggregation_mode,
        get_advantage_estimator,
        get_aggregation_mode,
        get_estimator_traits,
        get_kl_estimator,
        get_policy_loss,
        kl_estimator,
        policy_loss,
    )
    from hf_core.algorithms.safe_rlhf import LagrangeMultiplier, safe_rlhf_advantage
    from hf_core.algorithms.sequence_losses import gspo_loss, gspo_token_loss, sequence_log_ratio
    from hf_core.algorithms.token_log_probs import token_log_probs_and_entropy

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "ESTIMATOR_TRAITS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "EstimatorTraits",
    "FixedKLController",
    "KLController",
    "LagrangeMultiplier",
    "PolicyLossConfig",
    "Registry",
    "UnknownAlgorithmError",
    "advantage_estimator",
    "aggregate_loss",
    "aggregation_mode",
    "apply_kl_penalty",
    "broadcast_to_tokens",
    "chunked_head_log_probs_and_entropy",
    "cispo_loss",
    "compute_advantage",
    "dr_grpo_advantage",
    "dual_clip_ppo_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "gae_advantage",
    "get_advantage_estimator",
    "get_aggregation_mode",
    "get_estimator_traits",
    "get_kl_estimator",
    "get_policy_loss",
    "group_ids",
    "group_normalized_scores",
    "grpo_advantage",
    "gspo_loss",
    "gspo_token_loss",
    "kl_abs",
    "kl_estimator",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_penalty",
    "last_valid_index",
    "leave_one_out_scores",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage",
    "remax_advantage",
    "rloo_advantage",
    "safe_rlhf_advantage",
    "sequence_log_ratio",
    "sequence_scores",
    "token_level_rewards",
    "token_log_probs_and_entropy",
    "truncated_responses",
    "value_loss",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "advantages": (
            "broadcast_to_tokens",
            "compute_advantage",
            "dr_grpo_advantage",
            "gae_advantage",
            "group_normalized_scores",
            "grpo_advantage",
            "leave_one_out_scores",
            "reinforce_plus_plus_advantage",
            "reinforce_plus_plus_baseline_advantage",
            "remax_advantage",
            "rloo_advantage",
            "sequence_scores",
        ),
        "aggregation": ("aggregate_loss",),
        "chunked_head": ("chunked_head_log_probs_and_entropy",),
        "groups": ("group_ids",),
        "kl": (
            "AdaptiveKLController",
            "FixedKLController",
            "KLController",
            "apply_kl_penalty",
            "kl_abs",
            "kl_k1",
            "kl_k2",
            "kl_k3",
            "kl_penalty",
            "last_valid_index",
            "make_kl_controller",
            "token_level_rewards",
        ),
        "losses": (
            "PolicyLossConfig",
            "cispo_loss",
            "dual_clip_ppo_loss",
            "entropy_bonus",
            "entropy_from_logits",
            "kl_loss",
            "ppo_clip_loss",
            "value_loss",
        ),
        "masked": ("masked_mean", "masked_sum", "masked_var", "masked_whiten"),
        "overlong": ("overlong_penalty", "truncated_responses"),
        "registry": (
            "ADVANTAGE_ESTIMATORS",
            "AGGREGATION_MODES",
            "ESTIMATOR_TRAITS",
            "KL_ESTIMATORS",
            "POLICY_LOSSES",
            "EstimatorTraits",
            "Registry",
            "UnknownAlgorithmError",
            "advantage_estimator",
            "aggregation_mode",
            "get_advantage_estimator",
            "get_aggregation_mode",
            "get_estimator_traits",
            "get_kl_estimator",
            "get_policy_loss",
            "kl_estimator",
            "policy_loss",
        ),
        "safe_rlhf": ("LagrangeMultiplier", "safe_rlhf_advantage"),
        "sequence_losses": ("gspo_loss", "gspo_token_loss", "sequence_log_ratio"),
        "token_log_probs": ("token_log_probs_and_entropy",),
    },
)


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
