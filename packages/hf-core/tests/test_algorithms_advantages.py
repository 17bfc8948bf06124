"""Advantage estimators checked against values worked out by hand.

Sources the formulas follow:
* GAE — Schulman et al. 2016, arXiv 1506.02438, eq. 16 (δ_t = r_t + γV_{t+1} − V_t,
  A_t = δ_t + γλA_{t+1}); returns = A + V.
* GRPO — Shao et al. 2024 (DeepSeekMath), arXiv 2402.03300 §4.1.2: (r − mean_g)/std_g, std the
  unbiased sample std; Dr. GRPO — Liu et al. 2025, arXiv 2503.20783: r − mean_g.
* RLOO — Ahmadian et al. 2024, arXiv 2402.14740 eq. 6: r_i − mean_{j≠i} r_j.
* ReMax — Li et al. 2023, arXiv 2310.10505 Alg. 1: r − r_greedy.
* REINFORCE++ — Hu 2025, arXiv 2501.03262: return-to-go of KL-shaped rewards, batch-whitened.
"""

from __future__ import annotations

import math

import pytest
import torch
from float64 import D, close, t

from hf_core.algorithms import (
    compute_advantage,
    dr_grpo_advantage,
    gae_advantage,
    get_advantage_estimator,
    grpo_advantage,
    reinforce_plus_plus_advantage,
    reinforce_plus_plus_baseline_advantage,
    remax_advantage,
    rloo_advantage,
    token_level_rewards,
)


# --------------------------------------------------------------------------------------- GAE
def test_gae_two_steps_by_hand() -> None:
    # r = [0, 1], V = [0.5, 0.7], gamma = 0.9, lam = 0.8; nothing after the last token (V = 0).
    # t=1: delta1 = 1 + 0.9*0 - 0.7 = 0.3            A1 = 0.3
    # t=0: delta0 = 0 + 0.9*0.7 - 0.5 = 0.13         A0 = 0.13 + 0.9*0.8*0.3 = 0.13 + 0.216 = 0.346
    # returns = A + V = [0.846, 1.0]
    adv, ret = gae_advantage(
        t([[0.0, 1.0]]), t([[1, 1]]), values=t([[0.5, 0.7]]), gamma=0.9, lam=0.8, whiten=False
    )
    close(adv, [[0.346, 0.3]])
    close(ret, [[0.846, 1.0]])


def test_gae_padding_is_ignored() -> None:
    # Same 2-step episode in row 0 with a padded third slot holding garbage (reward 5, V 100,
    # even NaN); row 1 is a 1-token episode r=[2], V=[0.5]: A = 2 - 0.5 = 1.5, return 2.
    rewards = t([[0.0, 1.0, 5.0], [2.0, 7.0, 7.0]])
    values = t([[0.5, 0.7, 100.0], [0.5, float("nan"), -3.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv, ret = gae_advantage(rewards, mask, values=values, gamma=0.9, lam=0.8, whiten=False)
    close(adv, [[0.346, 0.3, 0.0], [1.5, 0.0, 0.0]])
    close(ret, [[0.846, 1.0, 0.0], [2.0, 0.0, 0.0]])


def test_gae_skips_masked_tokens_inside_a_response() -> None:
    # Multi-turn: the middle token (tool output) is masked.  Valid tokens 0 and 2 chain as if
    # adjacent, so the numbers are the 2-step case above; the masked slot gets 0.
    adv, ret = gae_advantage(
        t([[0.0, 9.0, 1.0]]),
        t([[1, 0, 1]]),
        values=t([[0.5, 42.0, 0.7]]),
        gamma=0.9,
        lam=0.8,
        whiten=False,
    )
    close(adv, [[0.346, 0.0, 0.3]])
    close(ret, [[0.846, 0.0, 1.0]])


def test_gae_gamma_lam_one_is_monte_carlo_return_minus_value() -> None:
    # gamma = lam = 1: A_t = sum_{t'>=t} r_t' - V_t.  r = [1, 2, 3], V = 0.5 everywhere:
    # A = [6 - 0.5, 5 - 0.5, 3 - 0.5] = [5.5, 4.5, 2.5]; returns = [6, 5, 3].
    adv, ret = gae_advantage(
        t([[1.0, 2.0, 3.0]]), t([[1, 1, 1]]), values=t([[0.5, 0.5, 0.5]]), whiten=False
    )
    close(adv, [[5.5, 4.5, 2.5]])
    close(ret, [[6.0, 5.0, 3.0]])


def test_gae_whitening_uses_valid_tokens_and_leaves_returns_alone() -> None:
    # Raw A = [0.346, 0.3]; mean 0.323, deviations +-0.023, unbiased var = 2*0.023^2/1,
    # std = 0.023*sqrt(2) -> whitened = +-1/sqrt(2).  The padded slot must stay 0 and not count.
    adv, ret = gae_advantage(
        t([[0.0, 1.0, 3.0]]), t([[1, 1, 0]]), values=t([[0.5, 0.7, 9.0]]), gamma=0.9, lam=0.8
    )
    h = 1 / math.sqrt(2)
    close(adv, [[h, -h, 0.0]], atol=1e-4)
    close(ret, [[0.846, 1.0, 0.0]])


# -------------------------------------------------------------------------------------- GRPO
def _outcome_rewards(scores: list[float], mask: torch.Tensor) -> torch.Tensor:
    return token_level_rewards(torch.tensor(scores, dtype=D), mask)


RAGGED6 = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])


def test_grpo_group_of_three_by_hand() -> None:
    # Group A rewards [1, 0, 0]: mean 1/3; unbiased var = ((2/3)^2 + 2*(1/3)^2)/2 = 1/3,
    # std = 0.57735 -> A = [(2/3)/0.57735, -(1/3)/0.57735, same] = [1.154701, -0.577350, -0.577350].
    # Group B rewards [0.5, 0.5, 0.5]: std 0 -> advantage 0 (0 / (0 + eps)).
    rewards = _outcome_rewards([1.0, 0.0, 0.0, 0.5, 0.5, 0.5], RAGGED6)
    adv, ret = grpo_advantage(rewards, RAGGED6, group_size=3)
    a, b = 2 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3)
    expected = [[a, a, 0], [b, 0, 0], [b, b, b], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    close(adv, expected, atol=1e-5)
    close(ret, expected, atol=1e-5)


def test_grpo_groups_by_index_need_not_be_consecutive() -> None:
    # Same two groups interleaved and named by ids (ints, then uid strings): same advantages.
    mask = t([[1, 1]] * 6)
    rewards = _outcome_rewards([1.0, 0.5, 0.0, 0.5, 0.0, 0.5], mask)
    a, b = 2 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3)
    expected = torch.tensor([a, 0, b, 0, b, 0], dtype=D)[:, None].expand(6, 2)
    by_int, _ = grpo_advantage(rewards, mask, index=torch.tensor([7, 3, 7, 3, 7, 3]))
    by_uid, _ = grpo_advantage(rewards, mask, index=["p", "q", "p", "q", "p", "q"])
    close(by_int, expected, atol=1e-5)
    close(by_uid, expected, atol=1e-5)


def test_dr_grpo_drops_the_std() -> None:
    # Dr. GRPO: r - mean -> [2/3, -1/3, -1/3]; norm_by_std=False on "grpo" is the same thing.
    mask = t([[1]] * 3)
    rewards = _outcome_rewards([1.0, 0.0, 0.0], mask)
    expected = [[2 / 3], [-1 / 3], [-1 / 3]]
    close(dr_grpo_advantage(rewards, mask, group_size=3)[0], expected)
    close(grpo_advantage(rewards, mask, group_size=3, norm_by_std=False)[0], expected)


def test_grpo_singleton_group_keeps_raw_score() -> None:
    # A group of one has no baseline; like verl it keeps its raw score (mean 0, std 1).
    mask = t([[1], [1], [1]])
    rewards = _outcome_rewards([0.7, 1.0, 0.0], mask)
    adv, _ = grpo_advantage(rewards, mask, index=[0, 1, 1])
    # group {1, 2}: mean 0.5, unbiased std = sqrt(2*0.25/1) = 0.7071 -> +-0.7071
    close(adv, [[0.7 / (1 + 1e-6)], [0.5 / 0.5**0.5], [-0.5 / 0.5**0.5]], atol=1e-5)


def test_grpo_rejects_inconsistent_groups() -> None:
    mask = t([[1]] * 4)
    rewards = _outcome_rewards([1, 0, 0, 1], mask)
    with pytest.raises(ValueError, match="does not divide"):
        grpo_advantage(rewards, mask, group_size=3)
    with pytest.raises(ValueError, match="exactly one"):
        grpo_advantage(rewards, mask)
    with pytest.raises(ValueError, match="3 entries"):
        grpo_advantage(rewards, mask, index=[0, 0, 1])


# -------------------------------------------------------------------------------------- RLOO
def test_rloo_group_of_four_by_hand() -> None:
    # r = [1, 2, 3, 6], sum 12.  A_i = r_i - (12 - r_i)/3:
    # 1 - 11/3 = -8/3;  2 - 10/3 = -4/3;  3 - 9/3 = 0;  6 - 6/3 = 4.
    # (Check: n/(n-1)*(r - mean) = 4/3*([1,2,3,6] - 3) gives the same.)
    mask = t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    rewards = _outcome_rewards([1.0, 2.0, 3.0, 6.0], mask)
    adv, ret = rloo_advantage(rewards, mask, group_size=4)
    expected = [[-8 / 3] * 3, [-4 / 3, 0, 0], [0, 0, 0], [4, 4, 4]]
    close(adv, expected)
    close(ret, expected)


# ------------------------------------------------------------------------------------- ReMax
def test_remax_subtracts_greedy_baseline() -> None:
    # Outcome rewards: scores [1.0, 0.2], greedy scores [0.4, 0.5] -> [0.6, -0.3] on every
    # valid token, 0 on padding.
    mask = t([[1, 1, 1], [1, 1, 0]])
    rewards = _outcome_rewards([1.0, 0.2], mask)
    adv, ret = remax_advantage(rewards, mask, baseline_scores=torch.tensor([0.4, 0.5], dtype=D))
    close(adv, [[0.6, 0.6, 0.6], [-0.3, -0.3, 0.0]])
    close(ret, [[1.0, 1.0, 1.0], [0.2, 0.2, 0.0]])


def test_remax_with_kl_shaped_rewards_uses_return_to_go() -> None:
    # r = [-0.1, -0.2, 1.0] (KL penalties then score): returns-to-go [0.7, 0.8, 1.0];
    # baseline 0.5 -> A = [0.2, 0.3, 0.5].
    adv, ret = remax_advantage(
        t([[-0.1, -0.2, 1.0]]), t([[1, 1, 1]]), baseline_scores=torch.tensor([0.5], dtype=D)
    )
    close(adv, [[0.2, 0.3, 0.5]])
    close(ret, [[0.7, 0.8, 1.0]])


# ------------------------------------------------------------------------------- REINFORCE++
def test_reinforce_plus_plus_two_tokens_by_hand() -> None:
    # Score 1.0 with beta*KL = [0.1, 0.2]: r = [-0.1, 1 - 0.2] = [-0.1, 0.8].
    # gamma = 1: G = [-0.1 + 0.8, 0.8] = [0.7, 0.8].  Whiten over the 2 tokens: mean 0.75,
    # deviations -+0.05, unbiased var = 2*0.05^2/1 = 0.005, std 0.0707107
    # -> A = [-1/sqrt2, +1/sqrt2].
    mask = t([[1, 1, 0]])
    rewards = token_level_rewards(
        torch.tensor([1.0], dtype=D), mask, kl=t([[1.0, 2.0, 50.0]]), kl_coef=0.1
    )
    close(rewards, [[-0.1, 0.8, 0.0]])
    adv, ret = reinforce_plus_plus_advantage(rewards, mask)
    h = 1 / math.sqrt(2)
    close(ret, [[0.7, 0.8, 0.0]])
    close(adv, [[-h, h, 0.0]], atol=1e-5)
    # gamma = 0.5: G0 = -0.1 + 0.5*0.8 = 0.3 (discounting is applied)
    _, ret_discounted = reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    close(ret_discounted, [[0.3, 0.8, 0.0]])


def test_reinforce_plus_plus_whitens_over_the_whole_batch() -> None:
    # Two 1-token responses with returns 1 and 3: batch mean 2, unbiased std sqrt(2) ->
    # [-1/sqrt2, +1/sqrt2].  Whitening per sequence would give 0 (one token each).
    adv, _ = reinforce_plus_plus_advantage(t([[1.0, 0.0], [3.0, 0.0]]), t([[1, 0], [1, 0]]))
    h = 1 / math.sqrt(2)
    close(adv, [[-h, 0.0], [h, 0.0]], atol=1e-5)


def test_reinforce_plus_plus_baseline() -> None:
    # Groups [1, 0] and [1, 1]: centred [0.5, -0.5, 0, 0]; whiten over 4 tokens: mean 0,
    # unbiased var = (0.25 + 0.25)/3 = 1/6 -> A = +-0.5*sqrt(6) = +-1.224745, 0, 0.
    mask = t([[1]] * 4)
    rewards = _outcome_rewards([1.0, 0.0, 1.0, 1.0], mask)
    adv, ret = reinforce_plus_plus_baseline_advantage(rewards, mask, group_size=2)
    s = 0.5 * math.sqrt(6)
    close(adv, [[s], [-s], [0.0], [0.0]], atol=1e-5)
    close(ret, [[0.5], [-0.5], [0.0], [0.0]])


# ------------------------------------------------------------------------------- dispatching
def test_compute_advantage_passes_only_what_each_estimator_takes() -> None:
    mask = t([[1, 1]] * 3)
    rewards = _outcome_rewards([1.0, 0.0, 0.0], mask)
    bag = {"values": torch.zeros(3, 2, dtype=D), "group_size": 3, "gamma": 1.0, "lam": 1.0}
    grpo, _ = compute_advantage("grpo", rewards, mask, **bag)
    close(grpo, grpo_advantage(rewards, mask, group_size=3)[0])
    gae, _ = compute_advantage("gae", rewards, mask, whiten=False, **bag)
    close(gae, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])  # V = 0, gamma = lam = 1: return-to-go
    with pytest.raises(TypeError, match="'gae' needs values"):
        compute_advantage("gae", rewards, mask, group_size=3)


def test_estimators_are_registered_by_name() -> None:
    assert get_advantage_estimator("gae") is gae_advantage
    assert get_advantage_estimator("reinforce++") is reinforce_plus_plus_advantage
    assert get_advantage_estimator("rloo") is rloo_advantage


def test_advantages_carry_no_gradient() -> None:
    values = torch.zeros(1, 2, dtype=D, requires_grad=True)
    adv, ret = gae_advantage(t([[0.0, 1.0]]), t([[1, 1]]), values=values, whiten=False)
    assert not adv.requires_grad and not ret.requires_grad
