"""Safe-RLHF's Lagrangian over a cost model (Dai et al. 2024, ICLR, arXiv 2310.12773).

The constrained problem max_θ E[R] s.t. E[C] ≤ d becomes min_{λ≥0} max_θ E[R] − λ(E[C] − d)
(§3.3, eq. 10).  λ is updated by projected gradient ascent on the dual,

    λ ← clip(λ + lr·(mean_cost − d), 0, λ_max),

so it grows while the policy is unsafe on average and decays to 0 once the constraint holds
with slack.  The policy then follows (A_r − λ·A_c)/(1 + λ): the 1/(1 + λ) keeps the advantage
scale bounded as λ grows, as in the authors' implementation (safe-rlhf ``PPOLagTrainer``).
λ is kept directly and projected, not parameterised as log λ: a log parameterisation can
never reach λ = 0 exactly, so the constraint could never switch fully off.
"""

from __future__ import annotations

from typing import Any

import torch


class LagrangeMultiplier:
    """λ ≥ 0 for the cost constraint E[C] ≤ ``cost_limit``, updated once per training step."""

    def __init__(
        self,
        init_value: float = 1.0,
        *,
        lr: float = 0.1,
        cost_limit: float = 0.0,
        max_value: float | None = None,
    ) -> None:
        if init_value < 0:
            raise ValueError(f"init_value must be >= 0, got {init_value}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if max_value is not None and max_value < init_value:
            raise ValueError(f"max_value {max_value} is below init_value {init_value}")
        self.lr = float(lr)
        self.cost_limit = float(cost_limit)
        self.max_value = None if max_value is None else float(max_value)
        self._value = float(init_value)
        self.num_updates = 0

    @property
    def value(self) -> float:
        """The current λ."""
        return self._value

    def update(self, mean_cost: float | torch.Tensor) -> float:
        """λ ← clip(λ + lr·(mean_cost − cost_limit), 0, max_value); returns the new λ.

        ``mean_cost`` is the batch mean of the cost model's sequence scores (a tensor is
        averaged first).
        """
        if isinstance(mean_cost, torch.Tensor):
            mean_cost = float(mean_cost.detach().float().mean())
        value = max(0.0, self._value + self.lr * (float(mean_cost) - self.cost_limit))
        if self.max_value is not None:
            value = min(value, self.max_value)
        self._value = value
        self.num_updates += 1
        return value

    def state_dict(self) -> dict[str, Any]:
        """Everything that changes during training (hyper-parameters come from the config)."""
        return {"value": self._value, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"value", "num_updates"} - set(state)
        if missing:
            raise KeyError(f"LagrangeMultiplier state is missing {sorted(missing)}")
        value = float(state["value"])
        if value < 0:
            raise ValueError(f"a Lagrange multiplier must be >= 0, got {value}")
        self._value = value
        self.num_updates = int(state["num_updates"])

    def __repr__(self) -> str:
        return (
            f"LagrangeMultiplier(value={self._value}, lr={self.lr}, "
            f"cost_limit={self.cost_limit}, max_value={self.max_value})"
        )


def safe_rlhf_advantage(
    reward_advantages: torch.Tensor,
    cost_advantages: torch.Tensor,
    multiplier: float | LagrangeMultiplier,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(A_r − λ·A_c)/(1 + λ) (Dai et al. 2024; safe-rlhf's PPO-Lag actor loss).

    A_r and A_c are advantages from the reward and cost critics (e.g. two GAE calls).  With a
    ``response_mask`` padding comes out as 0.
    """
    if reward_advantages.shape != cost_advantages.shape:
        raise ValueError(
            f"reward advantages {tuple(reward_advantages.shape)} and cost advantages "
            f"{tuple(cost_advantages.shape)} must have the same shape"
        )
    lam = multiplier.value if isinstance(multiplier, LagrangeMultiplier) else float(multiplier)
    if lam < 0:
        raise ValueError(f"the Lagrange multiplier must be >= 0, got {lam}")
    combined = (reward_advantages - lam * cost_advantages) / (1.0 + lam)
    if response_mask is not None:
        if response_mask.shape != combined.shape:
            raise ValueError(f"response_mask {tuple(response_mask.shape)} must match advantages")
        combined = torch.where(response_mask != 0, combined, 0.0)
    return combined
