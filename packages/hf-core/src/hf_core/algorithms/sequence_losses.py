"""Sequence-level policy losses: GSPO and GSPO-token.

Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071).

* GSPO (§4.1): the importance ratio of response y_i is its length-normalised likelihood ratio
  s_i = (π(y_i|x) / π_old(y_i|x))^(1/|y_i|) = exp((1/|y_i|)·Σ_t (log π_t − log π_old,t)), and the
  clip acts on the whole response: loss_i = −min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i),
  averaged over responses.  The reward is per sequence, so the off-policy correction is too; the
  per-token ratios of GRPO add noise that grows with length (and with MoE routing changes).
* GSPO-token (§4.3): s_{i,t} = sg[s_i]·π_t / sg[π_t].  Its value is s_i on every token but the
  gradient flows through each token's own log-prob, so a per-token advantage A_{i,t} may be used;
  with A_{i,t} = A_i it equals GSPO in value and gradient.

Clip ranges: the sequence ratio is a geometric mean and stays much closer to 1 than token ratios,
so the paper clips at ε_low = 3e-4, ε_high = 4e-4 (§5.1), not PPO's 0.2.  Set
``algorithm.clip_ratio_low`` / ``clip_ratio_high`` accordingly; the global defaults stay PPO's.

Aggregation: the per-sequence loss is written on each of the sequence's valid tokens and reduced
with ``config.loss_agg_mode``.  ``seq-mean-token-mean`` gives the paper's 1/G Σ_i loss_i exactly
(the gspo recipe sets it); ``token-mean`` (the default mode) weighs each response's loss by its
length, as a token-level loss would; the other modes weigh as they do for any loss.  The actor
warns when ``gspo`` or ``gspo_token`` runs with another mode
(:func:`hf_core.roles.losses.loss_agg_mode_advice`).
"""

from __future__ import annotations

import torch

from hf_core.algorithms.groups import GroupIndex
from hf_core.algorithms.losses import (
    _MAX_LOG_RATIO,
    PolicyLossConfig,
    _aggregate_policy_loss,
    _fraction,
)
from hf_core.algorithms.masked import check_token_shapes, masked_mean
from hf_core.algorithms.registry import policy_loss


def sequence_log_ratio(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """log s_i = (1/|y_i|)·Σ_t (log π − log π_old) over valid tokens [B]; 0 for an empty row.

    Padding is selected away before the sum so whatever it holds cannot leak in.
    """
    valid = response_mask != 0
    log_ratio = torch.where(valid, log_prob - old_log_prob, 0.0)
    return masked_mean(log_ratio, response_mask, dim=-1)


def _gspo_token_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token clipped loss with the GSPO-token ratio sg[s_i]·π_t/sg[π_t], and the metrics."""
    check_token_shapes(
        response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages
    )
    valid = response_mask != 0
    log_prob = torch.where(valid, log_prob, 0.0)  # garbage in padding must not reach exp/grad
    old_log_prob = torch.where(valid, old_log_prob, 0.0)
    advantages = torch.where(valid, advantages, 0.0)
    seq_log_ratio = sequence_log_ratio(log_prob, old_log_prob, response_mask).detach()
    seq_log_ratio = seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # Value: s_i on every token; gradient: s_i·∇log π_t (the clamp acts on the detached part).
    ratio = torch.exp(seq_log_ratio[:, None] + log_prob - log_prob.detach())
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(
        1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    )
    loss_mat = torch.where(valid, torch.maximum(loss_unclipped, loss_clipped), 0.0)
    with torch.no_grad():
        token_log_ratio = (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        metrics = {
            "pg_clipfrac": _fraction(loss_clipped > loss_unclipped, response_mask),
            # Per token, as for the other losses: KL(π_old ‖ π) estimated by k1 and k3.
            "ppo_kl": float(masked_mean(-token_log_ratio, response_mask)),
            "ppo_kl_k3": float(
                masked_mean(token_log_ratio.exp() - 1.0 - token_log_ratio, response_mask)
            ),
            "seq_ratio_mean": float(masked_mean(seq_log_ratio.exp(), valid.any(dim=-1))),
        }
    return loss_mat, metrics


@policy_loss("gspo")
def gspo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (arXiv 2507.18071 §4.1): sequence ratio, sequence clip, sequence advantage.

    A_i is the masked mean of the row's advantages (GRPO writes one value on every token, so
    this is that value; per-token weights such as rollout IS weights average into it).  Use
    ``gspo_token`` to keep per-token advantages.  Metrics: ``pg_loss``, ``pg_clipfrac`` (share
    of valid tokens in clipped sequences), ``ppo_kl``, ``ppo_kl_k3`` (per token) and
    ``seq_ratio_mean`` (mean s_i over non-empty responses).
    """
    config = config or PolicyLossConfig()
    check_token_shapes(response_mask, advantages=advantages)
    valid = response_mask != 0
    sequence_advantage = masked_mean(torch.where(valid, advantages, 0.0), response_mask, dim=-1)
    token_advantages = sequence_advantage[:, None].expand_as(advantages)
    loss_mat, metrics = _gspo_token_surrogate(
        log_prob, old_log_prob, token_advantages, response_mask, config
    )
    return _aggregate_policy_loss(loss_mat, response_mask, config, index, group_size, metrics)


@policy_loss("gspo_token")
def gspo_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token (arXiv 2507.18071 §4.3): s_{i,t} = sg[s_i]·π_t/sg[π_t] with per-token A_{i,t}.

    Each token's ratio has the sequence's value (so the clip decision is the sequence's, per
    the sign of A_{i,t}) and its own gradient.  Same metrics as :func:`gspo_loss`.
    """
    config = config or PolicyLossConfig()
    loss_mat, metrics = _gspo_token_surrogate(
        log_prob, old_log_prob, advantages, response_mask, config
    )
    return _aggregate_policy_loss(loss_mat, response_mask, config, index, group_size, metrics)
