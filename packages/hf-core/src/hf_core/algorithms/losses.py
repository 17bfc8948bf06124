"""Actor and critic losses: PPO clip, dual-clip, clipped value loss, entropy bonus, KL loss.

Sources:
* PPO clipped surrogate — Schulman et al. 2017, "Proximal Policy Optimization Algorithms"
  (arXiv 1707.06347) eq. 7: L = −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A), ρ = π/π_old.  Separate lower and
  upper ε ("clip-higher") follow DAPO (Yu et al. 2025, arXiv 2503.14476 §3.1).  ``vanilla``
  names this plain clipped loss here; verl's ``vanilla`` is dual-clip PPO (``dual_clip``).
* Dual-clip PPO — Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"
  (arXiv 1912.09729) eq. 5: for A < 0 the loss is also capped at −c·A (c > 1), so a token whose
  ratio exploded under a negative advantage cannot dominate the batch.
* CISPO — MiniMax 2025, "MiniMax-M1" (arXiv 2506.13585) §3.1: clip the importance weight, not
  the update: L = −sg(clip(ρ, 1−ε_low, 1+ε_high))·A·log π, so every token keeps a gradient.
* Clipped value loss — the PPO reference implementation (OpenAI baselines ppo2):
  ½·max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²).
* Entropy bonus — Mnih et al. 2016 (A3C) / PPO eq. 9: loss − c·H.
* KL in the loss — GRPO (Shao et al. 2024 eq. 3) adds β·D_KL(π‖π_ref) per token with the k3
  estimator; see ``kl``.

All losses take per-token tensors [B, T] and a ``response_mask``, reduce with a named
aggregation mode (see ``aggregation``) and return ``(loss, metrics)`` with float metrics.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hf_core.algorithms.aggregation import aggregate_loss
from hf_core.algorithms.groups import GroupIndex
from hf_core.algorithms.kl import kl_penalty
from hf_core.algorithms.masked import check_token_shapes, masked_mean
from hf_core.algorithms.registry import get_aggregation_mode, policy_loss

#: Log-ratios are clamped to ±20 before exp (as verl does) so one stale token cannot give inf.
_MAX_LOG_RATIO = 20.0


class PolicyLossConfig(BaseModel):
    """Hyper-parameters shared by the registered policy losses (a config section maps onto it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    clip_ratio_low: float = Field(
        0.2, ge=0.0, le=1.0, description="ε_low: ratio >= 1 - ε_low (1: no lower bound)"
    )
    clip_ratio_high: float = Field(0.2, ge=0.0, description="ε_high: ratio <= 1 + ε_high")
    clip_ratio_c: float = Field(3.0, gt=1.0, description="dual-clip bound c (dual_clip only)")
    loss_agg_mode: str = "token-mean"
    norm_length: float | None = Field(
        None, gt=0.0, description="constant L for 'seq-mean-token-sum-norm' (default T)"
    )

    @field_validator("loss_agg_mode")
    @classmethod
    def _known_mode(cls, mode: str) -> str:
        get_aggregation_mode(mode)  # raises UnknownAlgorithmError listing the modes
        return mode


def _fraction(condition: torch.Tensor, response_mask: torch.Tensor) -> float:
    return float(masked_mean(condition.to(torch.get_default_dtype()), response_mask))


def _clipped_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-token PPO clip loss, the (padding-zeroed) advantages and the shared metrics."""
    check_token_shapes(
        response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages
    )
    valid = response_mask != 0
    # Zero the padding *before* exp so garbage log-probs there cannot produce inf/NaN gradients.
    log_ratio = torch.where(valid, log_prob - old_log_prob, 0.0)
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    advantages = torch.where(valid, advantages, 0.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(
        1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    )
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _fraction(loss_clipped > loss_unclipped, response_mask),
            # KL(π_old ‖ π) from samples of π_old: k1 = −log ρ and k3 = ρ − 1 − log ρ.
            "ppo_kl": float(masked_mean(-log_ratio, response_mask)),
            "ppo_kl_k3": float(masked_mean(ratio - 1.0 - log_ratio, response_mask)),
        }
    return loss_mat, advantages, metrics


@policy_loss("ppo_clip", "vanilla")
def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017 eq. 7), aggregated per ``config``.

    Per token: ρ = exp(logp − old_logp), loss = max(−ρ·A, −clip(ρ, 1−ε_low, 1+ε_high)·A), the
    pessimistic bound.  Metrics: ``pg_loss``, ``pg_clipfrac`` (share of valid tokens where the
    clipped term is the active one), ``ppo_kl`` and ``ppo_kl_k3`` (approximate KL(π_old‖π)).
    """
    config = config or PolicyLossConfig()
    loss_mat, _, metrics = _clipped_surrogate(
        log_prob, old_log_prob, advantages, response_mask, config
    )
    return _aggregate_policy_loss(loss_mat, response_mask, config, index, group_size, metrics)


def _aggregate_policy_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    index: GroupIndex | None,
    group_size: int | None,
    metrics: dict[str, float],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Reduce per-token losses with the configured aggregation; record ``pg_loss``."""
    loss = aggregate_loss(
        loss_mat,
        response_mask,
        config.loss_agg_mode,
        index=index,
        group_size=group_size,
        norm_length=config.norm_length,
    )
    metrics["pg_loss"] = float(loss.detach())
    return loss, metrics


@policy_loss("dual_clip")
def dual_clip_ppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO (Ye et al. 2020 eq. 5).

    For A ≥ 0 the loss is PPO's; for A < 0 it is min(PPO clip loss, −c·A) with c =
    ``config.clip_ratio_c`` > 1: the unclipped −ρ·A grows without bound as ρ → ∞, and the cap
    stops a few off-policy tokens from dominating.  Adds ``pg_clipfrac_lower``: share of valid
    tokens where the cap binds.
    """
    config = config or PolicyLossConfig()
    clip_loss, advantages, metrics = _clipped_surrogate(
        log_prob, old_log_prob, advantages, response_mask, config
    )
    cap = -advantages * config.clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(clip_loss, cap), clip_loss)
    metrics["pg_clipfrac_lower"] = _fraction(negative & (clip_loss > cap), response_mask)
    return _aggregate_policy_loss(loss_mat, response_mask, config, index, group_size, metrics)


@policy_loss("cispo")
def cispo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585 §3.1): −sg(clip(ρ, 1−ε_low, 1+ε_high))·A·log π.

    PPO's clip zeroes the gradient of a token whose ratio left the range, and those are often
    the rare tokens (e.g. "wait", "recheck") that start a correction; CISPO bounds the
    importance weight instead, so every token keeps a REINFORCE gradient of bounded size.  The
    paper sets no lower bound (``clip_ratio_low: 1.0`` here: weights are clipped at 0, which a
    ratio never reaches) and tunes only ε_high (``clip_ratio_high``); it aggregates with
    ``token-mean``.  The loss *value* is a surrogate (its gradient is what matters).  Metrics:
    ``pg_loss``, ``pg_clipfrac`` (share of valid tokens whose weight was clipped, either side),
    ``ppo_kl`` and ``ppo_kl_k3``.
    """
    config = config or PolicyLossConfig()
    check_token_shapes(
        response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages
    )
    valid = response_mask != 0
    log_prob = torch.where(valid, log_prob, 0.0)  # padding garbage must not reach the gradient
    log_ratio = torch.where(valid, log_prob.detach() - old_log_prob, 0.0)
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    weight = ratio.clamp(low, high)
    loss_mat = -weight * torch.where(valid, advantages, 0.0) * log_prob
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _fraction((ratio < low) | (ratio > high), response_mask),
            "ppo_kl": float(masked_mean(-log_ratio, response_mask)),
            "ppo_kl_k3": float(masked_mean(ratio - 1.0 - log_ratio, response_mask)),
        }
    return _aggregate_policy_loss(loss_mat, response_mask, config, index, group_size, metrics)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
    index: GroupIndex | None = None,
    group_size: int | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss: ½·max((V − R)², (clip(V, V_old ± ε) − R)²).

    Taking the max (not the clipped term alone) makes the clip pessimistic: it removes the
    incentive to move V more than ε from V_old but never rewards doing so.  ``clip_range=None``
    gives the plain ½(V − R)².  Metrics: ``vf_loss``, ``vf_clipfrac`` (share of valid tokens
    where the clipped error is the larger), ``vpred_mean``.
    """
    check_token_shapes(response_mask, values=values, old_values=old_values, returns=returns)
    valid = response_mask != 0
    values = torch.where(valid, values, 0.0)
    old_values = torch.where(valid, old_values, 0.0)
    returns = torch.where(valid, returns, 0.0)
    error = (values - returns).square()
    if clip_range is None:
        loss_mat = 0.5 * error
        clipped_more = torch.zeros_like(valid)
    else:
        if clip_range < 0:
            raise ValueError(f"clip_range must be >= 0, got {clip_range}")
        clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped_error = (clipped - returns).square()
        loss_mat = 0.5 * torch.maximum(error, clipped_error)
        clipped_more = clipped_error > error
    loss = aggregate_loss(
        loss_mat,
        response_mask,
        loss_agg_mode,
        index=index,
        group_size=group_size,
        norm_length=norm_length,
    )
    with torch.no_grad():
        metrics = {
            "vf_loss": float(loss),
            "vf_clipfrac": _fraction(clipped_more, response_mask),
            "vpred_mean": float(masked_mean(values, response_mask)),
        }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) − Σ softmax(z)·z."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_bonus(
    pg_loss: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    *,
    loss_agg_mode: str = "token-mean",
    index: GroupIndex | None = None,
    group_size: int | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """pg_loss − coef·H, with the per-token entropy H aggregated like the policy loss.

    Rewarding entropy keeps the policy from collapsing onto one answer early (Mnih et al. 2016;
    PPO eq. 9).  Use the same ``loss_agg_mode`` as the policy loss so both weigh tokens alike.
    Metrics: ``entropy`` (aggregated) and ``entropy_coef``.
    """
    check_token_shapes(response_mask, entropy=entropy)
    aggregated = aggregate_loss(
        entropy,
        response_mask,
        loss_agg_mode,
        index=index,
        group_size=group_size,
        norm_length=norm_length,
    )
    metrics = {"entropy": float(aggregated.detach()), "entropy_coef": float(coef)}
    return pg_loss - coef * aggregated, metrics


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    estimator: str = "k3",
    loss_agg_mode: str = "token-mean",
    index: GroupIndex | None = None,
    group_size: int | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL(π‖π_ref) as a loss term (GRPO), *unscaled*: add ``kl_coef * loss`` to the actor loss.

    k3 by default: unbiased, non-negative and low-variance (Schulman 2020), as GRPO uses.
    Metric: ``kl_loss``.
    """
    check_token_shapes(response_mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    valid = response_mask != 0
    kl = kl_penalty(
        torch.where(valid, log_prob, 0.0), torch.where(valid, ref_log_prob, 0.0), estimator
    )
    loss = aggregate_loss(
        kl,
        response_mask,
        loss_agg_mode,
        index=index,
        group_size=group_size,
        norm_length=norm_length,
    )
    return loss, {"kl_loss": float(loss.detach())}
