"""Safe-RLHF Lagrangian, checked by hand.

Source: Dai et al. 2024, "Safe RLHF: Safe Reinforcement Learning from Human Feedback" (ICLR,
arXiv 2310.12773) §3.3: λ ← max(0, λ + lr·(mean_cost − cost_limit)) (projected dual ascent) and
the combined advantage (A_r − λ·A_c)/(1 + λ) of the authors' PPO-Lag implementation.
"""

from __future__ import annotations

import pytest
import torch

from hf_core.algorithms import LagrangeMultiplier, safe_rlhf_advantage

D = torch.float64


def test_lagrange_update_by_hand() -> None:
    # lambda 1.0, lr 0.5, limit 0:
    #   cost 0.4 (violated): 1.0 + 0.5*(0.4 - 0) = 1.2
    #   cost -3 (slack):     1.2 + 0.5*(-3 - 0) = -0.3 -> projected to 0
    #   cost 0.2:            0 + 0.5*0.2 = 0.1
    lam = LagrangeMultiplier(1.0, lr=0.5, cost_limit=0.0)
    assert lam.update(0.4) == pytest.approx(1.2)
    assert lam.update(torch.tensor([-2.0, -4.0])) == 0.0  # a tensor is averaged: -3
    assert lam.update(0.2) == pytest.approx(0.1)
    assert lam.num_updates == 3


def test_lagrange_cost_limit_and_max() -> None:
    # limit 1.0: cost 1.5 -> 0.5 + 0.1*(1.5 - 1.0) = 0.55; max_value caps a big jump at 0.6.
    lam = LagrangeMultiplier(0.5, lr=0.1, cost_limit=1.0, max_value=0.6)
    assert lam.update(1.5) == pytest.approx(0.55)
    assert lam.update(100.0) == pytest.approx(0.6)


def test_lagrange_state_dict_round_trip() -> None:
    lam = LagrangeMultiplier(1.0, lr=0.5)
    lam.update(0.4)
    restored = LagrangeMultiplier(1.0, lr=0.5)
    restored.load_state_dict(lam.state_dict())
    assert restored.value == pytest.approx(1.2)
    assert restored.num_updates == 1
    assert restored.update(0.4) == pytest.approx(1.4)
    with pytest.raises(ValueError, match=">= 0"):
        restored.load_state_dict({"value": -1.0, "num_updates": 0})
    with pytest.raises(KeyError, match="num_updates"):
        restored.load_state_dict({"value": 1.0})


def test_lagrange_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="init_value"):
        LagrangeMultiplier(-0.1)
    with pytest.raises(ValueError, match="lr"):
        LagrangeMultiplier(1.0, lr=0.0)


def test_combined_advantage_by_hand() -> None:
    # lambda 0.5: (A_r - 0.5*A_c)/1.5:  (2 - 0.5*1)/1.5 = 1.0;  (0 - 0.5*(-3))/1.5 = 1.0;
    # (1 - 0.5*2)/1.5 = 0;  padded slot -> 0.
    reward_adv = torch.tensor([[2.0, 0.0], [1.0, 9.0]], dtype=D)
    cost_adv = torch.tensor([[1.0, -3.0], [2.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    out = safe_rlhf_advantage(reward_adv, cost_adv, 0.5, mask)
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=D))
    # lambda 0 is plain reward advantages; a multiplier object is read for its value.
    torch.testing.assert_close(safe_rlhf_advantage(reward_adv, cost_adv, 0.0), reward_adv)
    lam = LagrangeMultiplier(0.5)
    torch.testing.assert_close(safe_rlhf_advantage(reward_adv, cost_adv, lam, mask), out)
