"""Advantage estimators: token-level rewards in, per-token advantages and returns out.

Every registered estimator has the calling convention

    estimator(token_level_rewards [B, T], response_mask [B, T], **inputs) -> (advantages, returns)

with estimator-specific inputs keyword-only (``values``, ``index``/``group_size``,
``baseline_scores``, ``gamma``, ...).  Outcome estimators (GRPO, Dr. GRPO, RLOO, ReMax,
REINFORCE++-baseline) take the sequence score as Σ_t r_t over valid tokens, which is the score
itself when rewards come from ``token_level_rewards(scores, mask)`` without KL, and broadcast the
per-sequence advantage over the response tokens.  Padding always comes out as 0.  Estimators run
under ``torch.no_grad``: advantages and returns are regression/policy-gradient *targets*.

Sources:
* GAE — Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation" (arXiv 1506.02438), eq. 16: A_t = Σ_l (γλ)^l δ_{t+l}, δ_t = r_t + γV_{t+1} − V_t.
* GRPO — Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300) §4.1.2: Â_i = (r_i − mean(r)) / std(r)
  over the G responses to one prompt.
* Dr. GRPO — Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv 2503.20783): drop the
  std division (and use a constant length normaliser, see ``aggregation``).
* RLOO — Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization"
  (arXiv 2402.14740) eq. 6: A_i = r_i − 1/(k−1) Σ_{j≠i} r_j.
* ReMax — Li et al. 2023, "ReMax" (arXiv 2310.10505) Alg. 1: baseline = reward of the greedy
  response to the same prompt.
* REINFORCE++ — Hu 2025, "REINFORCE++" (arXiv 2501.03262): discounted return-to-go of the
  KL-shaped token rewards, whitened over the global batch; "-baseline" subtracts the group mean.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hf_core.algorithms.groups import GroupIndex, group_ids, group_onehot
from hf_core.algorithms.masked import check_token_shapes, masked_sum, masked_whiten
from hf_core.algorithms.registry import advantage_estimator, get_advantage_estimator


def _zero_padding(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(response_mask != 0, values, torch.zeros((), dtype=values.dtype))


def broadcast_to_tokens(sequence_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: each sequence's value on each of its valid tokens, 0 on padding."""
    if sequence_values.shape != response_mask.shape[:1]:
        raise ValueError(
            f"per-sequence values {tuple(sequence_values.shape)} do not match "
            f"response_mask {tuple(response_mask.shape)}"
        )
    return _zero_padding(sequence_values[:, None].expand(response_mask.shape), response_mask)


def sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Σ_t r_t over valid tokens: the outcome score of each response [B]."""
    check_token_shapes(response_mask, token_level_rewards=token_level_rewards)
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def _reverse_discounted_sum(
    rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = r_t + γ G_{t'} where t' is the next *valid* token; masked slots are skipped."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        valid = response_mask[:, t] != 0
        running = torch.where(valid, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return _zero_padding(returns, response_mask)


# ----------------------------------------------------------------------------------- group math
def group_normalized_scores(
    scores: torch.Tensor, ids: torch.Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's (r − mean_g) / (std_g + eps), or r − mean_g when ``norm_by_std`` is False.

    ``std_g`` is the unbiased (Bessel-corrected) sample std, as ``torch.std`` and verl/TRL use.
    A group of one has no baseline: like verl, it keeps its raw score (mean 0, std 1).  A group
    whose rewards are all equal gets advantage 0 (no learning signal), not a division by zero.
    """
    dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    scores = scores.to(dtype)
    onehot = group_onehot(ids, dtype)  # [G, B]
    counts = onehot.sum(dim=1)
    means = (onehot * scores[None, :]).sum(dim=1) / counts
    sq_dev = (onehot * (scores[None, :] - means[:, None]).square()).sum(dim=1)
    stds = torch.sqrt(sq_dev / (counts - 1).clamp_min(1))
    singleton = counts < 2
    means = torch.where(singleton, torch.zeros_like(means), means)
    stds = torch.where(singleton, torch.ones_like(stds), stds)
    centered = scores - means[ids]
    return centered / (stds[ids] + eps) if norm_by_std else centered


def leave_one_out_scores(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i − (Σ_{j∈g} r_j − r_i)/(n_g − 1); a group of one keeps its raw score."""
    dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    scores = scores.to(dtype)
    onehot = group_onehot(ids, dtype)
    counts = onehot.sum(dim=1)[ids]
    sums = (onehot * scores[None, :]).sum(dim=1)[ids]
    baseline = (sums - scores) / (counts - 1).clamp_min(1)
    return torch.where(counts > 1, scores - baseline, scores)


# ------------------------------------------------------------------------------- estimators
@advantage_estimator("gae", needs_critic=True)
@torch.no_grad()
def gae_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation for PPO (Schulman et al. 2016, eq. 16).

    δ_t = r_t + γ·V_{t+1} − V_t,  A_t = δ_t + γλ·A_{t+1},  returns_t = A_t + V_t (the critic's
    λ-return target), with V and A beyond the last valid token taken as 0 (the episode ends).
    Masked positions are skipped, not treated as steps: the value and advantage of the next
    valid token carry across them, so padded values never enter and multi-turn responses with
    masked-out tool tokens chain their own tokens.  ``whiten`` normalises the advantages over
    the batch's valid tokens (returns are computed before whitening).
    """
    check_token_shapes(response_mask, token_level_rewards=token_level_rewards, values=values)
    batch = token_level_rewards.shape[0]
    dtype = token_level_rewards.dtype
    next_value = torch.zeros(batch, dtype=dtype, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        valid = response_mask[:, t] != 0
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid, advantage, 0.0)
        next_value = torch.where(valid, values[:, t].to(dtype), next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
    returns = _zero_padding(advantages + values, response_mask)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@advantage_estimator("grpo", needs_groups=True)
@torch.no_grad()
def grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024 §4.1.2): (r_i − mean_g)/(std_g + eps).

    Groups are named by ``index`` (per-sample ids) or ``group_size`` (consecutive samples).
    ``norm_by_std=False`` is Dr. GRPO (Liu et al. 2025), which argues the std division
    over-weights prompts that are too easy or too hard.  Returns equal the advantages.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    ids = group_ids(scores.shape[0], index=index, group_size=group_size, device=scores.device)
    advantages = broadcast_to_tokens(
        group_normalized_scores(scores, ids, norm_by_std=norm_by_std, eps=eps), response_mask
    )
    return advantages, advantages


@advantage_estimator("dr_grpo", needs_groups=True)
@torch.no_grad()
def dr_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al. 2025): r_i − mean_g, no std normalisation.

    Pair it with the "seq-mean-token-sum-norm" aggregation to also drop GRPO's 1/|o_i| length
    normalisation, as the paper does.
    """
    return grpo_advantage(
        token_level_rewards,
        response_mask,
        index=index,
        group_size=group_size,
        norm_by_std=False,
    )


@advantage_estimator("rloo", needs_groups=True)
@torch.no_grad()
def rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, eq. 6): r_i − mean of the *other* samples' rewards.

    Equivalently n/(n−1)·(r_i − mean_g).  The baseline excludes the sample itself, so it is
    independent of the sample and the estimator stays unbiased.  Returns equal the advantages.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    ids = group_ids(scores.shape[0], index=index, group_size=group_size, device=scores.device)
    advantages = broadcast_to_tokens(leave_one_out_scores(scores, ids), response_mask)
    return advantages, advantages


@advantage_estimator("remax", needs_greedy_baseline=True)
@torch.no_grad()
def remax_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    baseline_scores: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, Alg. 1): reward minus the reward of the greedy response.

    ``baseline_scores`` [B] is the score of a greedy (argmax) rollout of the same prompt.  The
    advantage at token t is the return-to-go G_t = Σ_{t'≥t} r_{t'} minus that baseline, so with
    outcome-only rewards (score on the last token) every token gets r − r_greedy as in the
    paper, and with KL-shaped rewards each token only answers for the penalties after it.
    Returns are the returns-to-go.
    """
    check_token_shapes(response_mask, token_level_rewards=token_level_rewards)
    returns = _reverse_discounted_sum(token_level_rewards, response_mask, gamma=1.0)
    baseline = broadcast_to_tokens(baseline_scores.to(returns.dtype), response_mask)
    return _zero_padding(returns - baseline, response_mask), returns


@advantage_estimator("reinforce_plus_plus", "reinforce++")
@torch.no_grad()
def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): return-to-go of the KL-shaped rewards, whitened over the batch.

    G_t = Σ_{t'≥t} γ^{t'−t} r_{t'} (KL penalty already in r via ``token_level_rewards``), then
    A = (G − mean)/std over every valid token of the batch: a global baseline with no critic and
    no per-prompt groups.
    """
    check_token_shapes(response_mask, token_level_rewards=token_level_rewards)
    returns = _reverse_discounted_sum(token_level_rewards, response_mask, gamma=gamma)
    return masked_whiten(returns, response_mask), returns


@advantage_estimator("reinforce_plus_plus_baseline", "reinforce++_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025): r_i − mean_g broadcast, then global batch whitening.

    Returns are the group-centred scores before whitening.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    ids = group_ids(scores.shape[0], index=index, group_size=group_size, device=scores.device)
    centered = broadcast_to_tokens(
        group_normalized_scores(scores, ids, norm_by_std=False), response_mask
    )
    return masked_whiten(centered, response_mask), centered


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    **inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``name``, passing only the ``inputs`` it declares.

    Lets a trainer hand every estimator the same bag (values, index, gamma, lam, ...) and pick
    the algorithm by config.  Inputs the estimator does not take are dropped; a required one
    that is missing raises a TypeError naming the estimator.
    """
    estimator = get_advantage_estimator(name)
    parameters = inspect.signature(estimator).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    accepted = {k: v for k, v in inputs.items() if takes_any or k in parameters}
    missing = [
        p.name
        for p in parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
        and p.default is inspect.Parameter.empty
        and p.name not in accepted
    ]
    if missing:
        raise TypeError(f"advantage estimator {name!r} needs {', '.join(missing)}")
    return estimator(token_level_rewards, response_mask, **accepted)
