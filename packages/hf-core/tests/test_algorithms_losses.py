"""Policy, value, entropy and KL losses and loss aggregation, checked against hand arithmetic.

Sources the formulas follow:
* PPO clip — Schulman et al. 2017, arXiv 1707.06347 eq. 7: −min(ρA, clip(ρ, 1−ε, 1+ε)A);
  asymmetric ε_low/ε_high ("clip-higher") — DAPO, Yu et al. 2025, arXiv 2503.14476 §3.1.
* Dual-clip PPO — Ye et al. 2020, arXiv 1912.09729 eq. 5: for A < 0, min(PPO loss, −c·A).
* Clipped value loss — OpenAI baselines ppo2: ½·max((V − R)², (clip(V, V_old ± ε) − R)²).
* Entropy bonus — PPO eq. 9 / Mnih et al. 2016: loss − c·H.
* Aggregation modes — DAPO §3.3 (token-level), GRPO eq. 3 (per-sequence 1/|o_i|), Dr. GRPO
  (Liu et al. 2025, arXiv 2503.20783) constant length normaliser.
* KL loss — GRPO (Shao et al. 2024) with Schulman's (2020) k3 estimator.
"""

from __future__ import annotations

import math

import pytest
import torch
from float64 import D, t

from hf_core.algorithms import (
    PolicyLossConfig,
    UnknownAlgorithmError,
    aggregate_loss,
    dual_clip_ppo_loss,
    entropy_bonus,
    entropy_from_logits,
    get_policy_loss,
    kl_loss,
    ppo_clip_loss,
    value_loss,
)


def logs(ratios: list[float]) -> torch.Tensor:
    """log-probs whose ratio to an old log-prob of 0 is ``ratios``."""
    return torch.log(torch.tensor([ratios], dtype=D))


# ----------------------------------------------------------------------------------- PPO clip
# eps = 0.2, clip range [0.8, 1.2]; per token loss = max(-A*r, -A*clip(r)):
#   r=1.1, A=+1: max(-1.1, -1.1) = -1.1   inside the range, not clipped
#   r=1.5, A=+1: max(-1.5, -1.2) = -1.2   clipped (no reward for pushing r past 1.2)
#   r=0.5, A=+1: max(-0.5, -0.8) = -0.5   not clipped (pessimistic: unclipped is worse)
#   r=0.5, A=-1: max( 0.5,  0.8) =  0.8   clipped (no reward for pushing r below 0.8)
#   r=1.5, A=-1: max( 1.5,  1.2) =  1.5   not clipped
#   r=0.9, A=-1: max( 0.9,  0.9) =  0.9   inside, not clipped
# token-mean = (-1.1 - 1.2 - 0.5 + 0.8 + 1.5 + 0.9)/6 = 0.4/6; clipfrac = 2/6
# ppo_kl = mean(-log r) = -(ln1.1 + ln1.5 + ln.5 + ln.5 + ln1.5 + ln.9)/6
RATIOS = [1.1, 1.5, 0.5, 0.5, 1.5, 0.9]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]


def test_ppo_clip_inside_and_outside_the_range() -> None:
    log_prob = logs(RATIOS).requires_grad_()
    loss, metrics = ppo_clip_loss(log_prob, torch.zeros(1, 6, dtype=D), t([ADVS]), t([[1] * 6]))
    assert loss.item() == pytest.approx(0.4 / 6)
    assert metrics["pg_loss"] == pytest.approx(0.4 / 6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 6)
    expected_kl = -sum(math.log(r) for r in RATIOS) / 6
    assert metrics["ppo_kl"] == pytest.approx(expected_kl)
    # k3 of KL(old||new): mean(r - 1 - ln r)
    assert metrics["ppo_kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in RATIOS) / 6)
    # Gradient: clipped tokens get none; d(-A*r)/dlogp = -A*r for the others, /6 for the mean.
    loss.backward()
    expected_grad = [-a * r / 6 for a, r in zip(ADVS, RATIOS, strict=True)]
    expected_grad[1] = expected_grad[3] = 0.0
    torch.testing.assert_close(log_prob.grad, t([expected_grad]))


def test_ppo_clip_asymmetric_clip_higher() -> None:
    # eps_low 0.2, eps_high 0.28: r=1.5, A=+1 -> max(-1.5, -1.28) = -1.28;
    # r=0.5, A=-1 -> max(0.5, 0.8) = 0.8.  Mean = (-1.28 + 0.8)/2 = -0.24.
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, _ = ppo_clip_loss(
        logs([1.5, 0.5]), torch.zeros(1, 2, dtype=D), t([[1.0, -1.0]]), t([[1, 1]]), config
    )
    assert loss.item() == pytest.approx(-0.24)


def test_ppo_clip_ignores_padding_even_if_it_holds_garbage() -> None:
    # Valid tokens are the six above; a padded 7th token with a huge ratio, NaN advantage and
    # an inf log-prob must change neither the loss nor the metrics nor the gradient's finiteness.
    log_prob = torch.cat([logs(RATIOS), t([[float("inf")]])], dim=1).requires_grad_()
    adv = t([[*ADVS, float("nan")]])
    mask = t([[1] * 6 + [0]])
    loss, metrics = ppo_clip_loss(log_prob, torch.zeros(1, 7, dtype=D), adv, mask)
    assert loss.item() == pytest.approx(0.4 / 6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 6)
    loss.backward()
    assert torch.isfinite(log_prob.grad).all()
    assert log_prob.grad[0, 6] == 0


def test_dual_clip_binds_for_negative_advantage_only() -> None:
    # eps = 0.2, c = 3:
    #   r=5, A=-1: PPO loss max(5, 1.2) = 5; cap -c*A = 3 -> min(5, 3) = 3   (cap binds)
    #   r=2, A=-1: PPO loss max(2, 1.2) = 2; min(2, 3) = 2                     (cap does not bind)
    #   r=5, A=+1: PPO loss max(-5, -1.2) = -1.2; A > 0 so no cap
    # mean = (3 + 2 - 1.2)/3 = 3.8/3; pg_clipfrac_lower = 1/3; pg_clipfrac (the PPO clip) = 1/3.
    log_prob = logs([5.0, 2.0, 5.0]).requires_grad_()
    loss, metrics = dual_clip_ppo_loss(
        log_prob, torch.zeros(1, 3, dtype=D), t([[-1.0, -1.0, 1.0]]), t([[1, 1, 1]])
    )
    assert loss.item() == pytest.approx(3.8 / 3)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 3)
    # The capped token is constant in logp: no gradient; the r=2 token gets -A*r/3 = 2/3.
    loss.backward()
    torch.testing.assert_close(log_prob.grad, t([[0.0, 2 / 3, 0.0]]))
    # Plain PPO on the same tokens: (5 + 2 - 1.2)/3 — the dual clip really changed the loss.
    plain, _ = ppo_clip_loss(
        logs([5.0, 2.0, 5.0]), torch.zeros(1, 3, dtype=D), t([[-1.0, -1.0, 1.0]]), t([[1, 1, 1]])
    )
    assert plain.item() == pytest.approx(5.8 / 3)


def test_dual_clip_c_bound_comes_from_config() -> None:
    # c = 4: r=5, A=-1 -> min(5, 4) = 4.
    loss, _ = dual_clip_ppo_loss(
        logs([5.0]),
        torch.zeros(1, 1, dtype=D),
        t([[-1.0]]),
        t([[1]]),
        PolicyLossConfig(clip_ratio_c=4.0),
    )
    assert loss.item() == pytest.approx(4.0)


def test_policy_loss_config_validates() -> None:
    with pytest.raises(ValueError, match="greater than 1"):
        PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(UnknownAlgorithmError, match="token-mean"):
        PolicyLossConfig(loss_agg_mode="token-avg")
    with pytest.raises(ValueError, match="extra"):
        PolicyLossConfig(clip_ratio=0.2)


def test_policy_losses_are_registered() -> None:
    assert get_policy_loss("ppo_clip") is ppo_clip_loss
    assert get_policy_loss("vanilla") is ppo_clip_loss
    assert get_policy_loss("dual_clip") is dual_clip_ppo_loss


def test_policy_loss_uses_the_configured_aggregation() -> None:
    # Ragged: row 0 has 2 valid tokens with loss -1.1 (r=1.1, A=1) and -0.5 (r=0.5, A=1),
    # row 1 one valid token with loss 0.9 (r=0.9, A=-1).
    # token-mean = (-1.1 - 0.5 + 0.9)/3 = -0.7/3; seq-mean-token-mean = (-0.8 + 0.9)/2 = 0.05.
    log_prob = torch.log(t([[1.1, 0.5], [0.9, 1.0]]))
    args = (log_prob, torch.zeros(2, 2, dtype=D), t([[1.0, 1.0], [-1.0, 7.0]]), t([[1, 1], [1, 0]]))
    token, _ = ppo_clip_loss(*args)
    seq, _ = ppo_clip_loss(*args, PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"))
    assert token.item() == pytest.approx(-0.7 / 3)
    assert seq.item() == pytest.approx(0.05)


# --------------------------------------------------------------------------------- value loss
def test_value_loss_clipping_by_hand() -> None:
    # eps = 0.2, per token 0.5*max((V-R)^2, (Vc-R)^2) with Vc = V_old + clip(V - V_old, +-0.2):
    #   V=1.5, V_old=1.0, R=2.0: Vc=1.2; (0.5)^2=0.25 vs (0.8)^2=0.64 -> 0.32, clipped term wins
    #   V=1.1, V_old=1.0, R=2.0: Vc=1.1; both 0.81 -> 0.405, not counted as clipped
    #   V=1.5, V_old=1.0, R=1.0: Vc=1.2; 0.25 vs 0.04 -> 0.125, unclipped wins
    # mean = (0.32 + 0.405 + 0.125)/3 = 0.85/3; clipfrac = 1/3; vpred_mean = 4.1/3
    values = t([[1.5, 1.1, 1.5]]).requires_grad_()
    loss, metrics = value_loss(values, t([[1.0, 1.0, 1.0]]), t([[2.0, 2.0, 1.0]]), t([[1, 1, 1]]))
    assert loss.item() == pytest.approx(0.85 / 3)
    assert metrics["vf_loss"] == pytest.approx(0.85 / 3)
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["vpred_mean"] == pytest.approx(4.1 / 3)
    # Clipped token 0 gets no gradient; others (V - R)/3: (1.1-2)/3 = -0.3, (1.5-1)/3.
    loss.backward()
    torch.testing.assert_close(values.grad, t([[0.0, -0.3, 0.5 / 3]]))


def test_value_loss_without_clipping_and_with_padding() -> None:
    # clip_range=None: 0.5*(V-R)^2 over valid tokens only: 0.5*0.25 = 0.125 and 0.5*0.81.
    loss, metrics = value_loss(
        t([[1.5, 99.0], [1.1, float("nan")]]),
        t([[1.0, 0.0], [1.0, 0.0]]),
        t([[2.0, -5.0], [2.0, 3.0]]),
        t([[1, 0], [1, 0]]),
        clip_range=None,
    )
    assert loss.item() == pytest.approx((0.125 + 0.405) / 2)
    assert metrics["vf_clipfrac"] == 0.0


# ------------------------------------------------------------------------------ entropy / KL
def test_entropy_from_logits() -> None:
    # uniform over 2: ln 2; probs (1/4, 3/4): -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335
    logits = torch.log(t([[0.5, 0.5], [0.25, 0.75]]))
    expected = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor(expected, dtype=D))


def test_entropy_bonus_subtracts_aggregated_entropy() -> None:
    # H = [[1, 2], [3, pad]] -> token-mean 2; pg_loss 0.5, coef 0.01 -> 0.5 - 0.02 = 0.48.
    loss, metrics = entropy_bonus(
        torch.tensor(0.5, dtype=D), t([[1.0, 2.0], [3.0, 100.0]]), t([[1, 1], [1, 0]]), 0.01
    )
    assert loss.item() == pytest.approx(0.48)
    assert metrics == {"entropy": pytest.approx(2.0), "entropy_coef": 0.01}


def test_kl_loss_k3_by_hand() -> None:
    # logp = ln 0.5, ref = ln 0.25: k3 = exp(ln .25 - ln .5) - (ln .25 - ln .5) - 1
    #                                   = 0.5 + ln 2 - 1 = 0.193147; second token logp = ref -> 0.
    log_prob = torch.log(t([[0.5, 0.3, 0.9]]))
    ref = torch.log(t([[0.25, 0.3, 1e-30]]))
    loss, metrics = kl_loss(log_prob, ref, t([[1, 1, 0]]))
    assert loss.item() == pytest.approx((0.5 + math.log(2) - 1) / 2)
    assert metrics["kl_loss"] == pytest.approx(loss.item())
    k1, _ = kl_loss(log_prob, ref, t([[1, 1, 0]]), estimator="k1")
    assert k1.item() == pytest.approx(math.log(2) / 2)


# -------------------------------------------------------------------------------- aggregation
# Ragged mask, padding filled with 1000 so any leak shows:
#   row 0: [1, 2, 3, pad]  sum 6, 3 tokens, mean 2      group 0
#   row 1: [4, pad, ...]   sum 4, 1 token,  mean 4      group 0
#   row 2: [5, 5, pad, pad] sum 10, 2 tokens, mean 5    group 1
#   row 3: [1, 1, 1, 1]    sum 4, 4 tokens, mean 1      group 1
P = 1000.0
LOSS = t([[1, 2, 3, P], [4, P, P, P], [5, 5, P, P], [1, 1, 1, 1]])
MASK = t([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 24 / 10),  # (6 + 4 + 10 + 4) / 10 tokens
        ("seq-mean-token-sum", 24 / 4),  # (6 + 4 + 10 + 4) / 4 sequences
        ("seq-mean-token-mean", (2 + 4 + 5 + 1) / 4),
        ("seq-mean-token-sum-norm", (6 + 4 + 10 + 4) / 4 / 4),  # mean of sum/L with L = T = 4
    ],
)
def test_aggregation_modes_on_a_ragged_mask(mode: str, expected: float) -> None:
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_group_mean_token_mean() -> None:
    # group 0 tokens: 1,2,3,4 -> 10/4 = 2.5; group 1 tokens: 5,5,1,1,1,1 -> 14/6.
    # mean over groups = (2.5 + 14/6)/2 = 2.416667 (token-mean would be 2.4)
    expected = (2.5 + 14 / 6) / 2
    assert aggregate_loss(LOSS, MASK, "group-mean-token-mean", group_size=2).item() == (
        pytest.approx(expected)
    )
    by_index = aggregate_loss(LOSS, MASK, "group-mean-token-mean", index=["a", "a", "b", "b"])
    assert by_index.item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="needs group ids"):
        aggregate_loss(LOSS, MASK, "group-mean-token-mean")


def test_seq_mean_token_sum_norm_uses_a_constant_length() -> None:
    # L = 8 instead of T: (6/8 + 4/8 + 10/8 + 4/8)/4 = 24/32
    loss = aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=8)
    assert loss.item() == pytest.approx(24 / 32)


def test_sequence_modes_skip_all_padding_rows() -> None:
    # An extra all-padding row must not count as a sequence (seq-mean over 4, not 5).
    loss = torch.cat([LOSS, t([[P] * 4])])
    mask = torch.cat([MASK, t([[0] * 4])])
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(6.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_all_padding_aggregates_to_zero() -> None:
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert aggregate_loss(t([[P, P]]), t([[0, 0]]), mode).item() == 0.0


def test_unknown_aggregation_mode_lists_the_modes() -> None:
    with pytest.raises(UnknownAlgorithmError) as error:
        aggregate_loss(LOSS, MASK, "token_mean")
    message = str(error.value)
    assert "unknown loss aggregation mode 'token_mean'" in message
    assert "seq-mean-token-mean" in message
    assert "did you mean 'token-mean'?" in message
