"""KL estimators, KL-in-reward token rewards and KL coefficient controllers.

Sources the formulas follow:
* k1 = log π − log π_ref, k2 = ½(log π − log π_ref)², k3 = exp(ref − logp) − (ref − logp) − 1 —
  J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.
* KL in the reward, r_t = −β·KL_t plus the score on the last token, and the adaptive controller
  β ← β·(1 + clip(KL/KL_target − 1, ±0.2)·n/horizon) — Ziegler et al. 2019, arXiv 1909.08593
  §2.2 (the horizon form as in OpenAI's lm-human-preferences and TRL).
"""

from __future__ import annotations

import math

import pytest
import torch
from float64 import D, t

from hf_core.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    UnknownAlgorithmError,
    apply_kl_penalty,
    get_kl_estimator,
    kl_penalty,
    last_valid_index,
    make_kl_controller,
    token_level_rewards,
)

LN2 = math.log(2)


# logp = ln 0.5, ref = ln 0.25, so logp - ref = ln 2 = 0.693147 and ref - logp = -ln 2:
#   k1  = ln 2                                   = 0.693147
#   abs = |ln 2|                                 = 0.693147
#   k2  = 0.5 * (ln 2)^2                         = 0.240227
#   k3  = exp(-ln 2) - (-ln 2) - 1 = 0.5 + ln2 - 1 = 0.193147
# and swapped (logp = ln 0.25, ref = ln 0.5, logp - ref = -ln 2):
#   k1 = -ln 2;  abs = ln 2;  k2 = 0.240227;  k3 = exp(ln 2) - ln 2 - 1 = 1 - ln 2 = 0.306853
@pytest.mark.parametrize(
    ("name", "forward", "swapped"),
    [
        ("k1", LN2, -LN2),
        ("kl", LN2, -LN2),
        ("abs", LN2, LN2),
        ("k2", 0.5 * LN2**2, 0.5 * LN2**2),
        ("mse", 0.5 * LN2**2, 0.5 * LN2**2),
        ("k3", 0.5 + LN2 - 1, 1 - LN2),
        ("low_var_kl", 0.5 + LN2 - 1, 1 - LN2),
    ],
)
def test_kl_estimators_on_chosen_numbers(name: str, forward: float, swapped: float) -> None:
    logp, ref = torch.log(t([[0.5, 0.25]])), torch.log(t([[0.25, 0.5]]))
    torch.testing.assert_close(kl_penalty(logp, ref, name), t([[forward, swapped]]))


def test_kl_estimators_are_zero_when_policies_agree() -> None:
    logp = torch.log(t([[0.1, 0.7]]))
    for name in ("k1", "k2", "k3", "abs"):
        assert torch.equal(get_kl_estimator(name)(logp, logp), torch.zeros(1, 2, dtype=D))


def test_k3_stays_finite_for_extreme_log_ratios() -> None:
    out = kl_penalty(t([[-500.0]]), t([[0.0]]), "k3")
    assert torch.isfinite(out).all()


def test_unknown_kl_estimator_lists_names() -> None:
    with pytest.raises(
        UnknownAlgorithmError, match=r"unknown KL estimator 'k4'; available: abs, k1"
    ):
        kl_penalty(t([[0.0]]), t([[0.0]]), "k4")


# ------------------------------------------------------------------------ token-level rewards
def test_token_level_rewards_put_score_on_last_valid_token() -> None:
    # beta = 0.1, KL = [[1, 2, 3], [4, 5, 6]], masks end at index 2 and 0:
    #   row 0: [-0.1, -0.2, -0.3 + 1.0] = [-0.1, -0.2, 0.7]
    #   row 1: [-0.4 + 0.5, 0, 0]       = [0.1, 0, 0]   (padding: no penalty, no score)
    mask = t([[1, 1, 1], [1, 0, 0]])
    rewards = token_level_rewards(
        torch.tensor([1.0, 0.5], dtype=D), mask, kl=t([[1, 2, 3], [4, 5, 6]]), kl_coef=0.1
    )
    torch.testing.assert_close(rewards, t([[-0.1, -0.2, 0.7], [0.1, 0.0, 0.0]]))


def test_token_level_rewards_without_kl_and_errors() -> None:
    rewards = token_level_rewards(torch.tensor([2.0], dtype=D), t([[1, 1, 0, 0]]))
    torch.testing.assert_close(rewards, t([[0.0, 2.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"rows \[1\] of response_mask have no valid token"):
        token_level_rewards(torch.tensor([1.0, 1.0]), t([[1, 0], [0, 0]]))
    # samples left out of the loss on purpose: no token, no reward, the others unchanged
    allowed = token_level_rewards(
        torch.tensor([1.0, 3.0], dtype=D), t([[1, 0], [0, 0]]), allow_empty=True
    )
    torch.testing.assert_close(allowed, t([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="must be \\[B\\]"):
        token_level_rewards(torch.tensor([1.0, 1.0, 1.0]), t([[1, 0], [1, 1]]))


def test_last_valid_index_with_interior_gaps() -> None:
    assert last_valid_index(t([[1, 0, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])).tolist() == [2, 3, 0]


def test_apply_kl_penalty_metrics() -> None:
    # k1 per token: row 0 [ln2, 0] over 2 valid tokens, row 1 [2*ln2] over 1 valid token.
    #   token_mean = mean(ln2/2, 2 ln2) = 1.25 ln2;  sequence_sum = mean(ln2, 2 ln2) = 1.5 ln2
    logp = torch.log(t([[0.5, 0.3], [0.8, 0.9]]))
    ref = torch.log(t([[0.25, 0.3], [0.2, 0.1]]))
    mask = t([[1, 1], [1, 0]])
    rewards, metrics = apply_kl_penalty(
        torch.tensor([1.0, 0.0], dtype=D), logp, ref, mask, kl_coef=0.5
    )
    torch.testing.assert_close(rewards, t([[-0.5 * LN2, 1.0], [-LN2, 0.0]]))
    assert metrics["kl/token_mean"] == pytest.approx(1.25 * LN2)
    assert metrics["kl/sequence_sum"] == pytest.approx(1.5 * LN2)
    assert metrics["kl/coef"] == 0.5


# -------------------------------------------------------------------------------- controllers
@pytest.mark.parametrize(
    ("observed_kl", "n_steps", "beta"),
    [
        # e = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2;  beta = 0.1 * (1 + 0.2*256/10000)
        (9.0, 256, 0.100512),
        # e = 0.1 (unclipped);  beta = 0.1 * (1 + 0.1*256/10000)
        (6.6, 256, 0.100256),
        # e = 3/6 - 1 = -0.5, clipped to -0.2;  beta = 0.1 * (1 - 0.2*1000/10000), downwards
        (3.0, 1000, 0.098),
    ],
)
def test_adaptive_kl_controller_one_update(observed_kl: float, n_steps: int, beta: float) -> None:
    """beta 0.1, target 6, horizon 10000; one observed KL over ``n_steps`` samples."""
    controller = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    controller.update(observed_kl, n_steps=n_steps)
    assert controller.value == pytest.approx(beta)


def test_kl_controller_state_round_trip_and_fixed() -> None:
    controller = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    controller.update(9.0, n_steps=256)
    restored = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    fixed = FixedKLController(0.05)
    fixed.update(100.0, n_steps=1000)
    assert fixed.value == 0.05


def test_make_kl_controller() -> None:
    assert isinstance(make_kl_controller("fixed", kl_coef=0.1), FixedKLController)
    adaptive = make_kl_controller("adaptive", kl_coef=0.1, target_kl=6, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl and horizon"):
        make_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="available: adaptive, fixed"):
        make_kl_controller("pid", kl_coef=0.1)
