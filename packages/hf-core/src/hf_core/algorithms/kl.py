"""KL penalties between the policy and the reference model, and the KL coefficient controllers.

Per-token estimators of KL(π ‖ π_ref) from log-probs of tokens *sampled from π*, following
J. Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html).  With
``log_ratio = ref_log_prob − log_prob`` (log of r = π_ref/π):

* ``k1`` = −log r = log π − log π_ref: unbiased, high variance, can be negative per token;
* ``k2`` = ½ (log r)²: biased but low variance, always ≥ 0;
* ``k3`` = (r − 1) − log r: unbiased *and* always ≥ 0 (used as GRPO's KL loss).  Its value is
  not clamped (only log r is, at ±20, against overflow); verl's ``low_var_kl`` also clamps the
  estimate to [−10, 10], which zeroes the gradient of tokens beyond it;
* ``abs`` = |log r|: a non-negative magnitude of k1.

KL enters the objective either in the reward (PPO, REINFORCE++: r_t = −β·KL_t plus the score on
the last response token, :func:`token_level_rewards`) or in the loss (GRPO: see
``losses.kl_loss``).  β is fixed or adapted as in Ziegler et al. 2019, "Fine-Tuning Language
Models from Human Preferences" §2.2 (arXiv 1909.08593).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hf_core.algorithms.masked import masked_mean, masked_sum
from hf_core.algorithms.registry import get_kl_estimator, kl_estimator

#: exp() of a log-ratio beyond this overflows float16/bf16 long before it is meaningful.
_MAX_LOG_RATIO = 20.0


@kl_estimator("k1", "kl")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 = log π − log π_ref (Schulman 2020)."""
    return log_prob - ref_log_prob


@kl_estimator("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """|log π − log π_ref|."""
    return (log_prob - ref_log_prob).abs()


@kl_estimator("k2", "mse")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π − log π_ref)² (Schulman 2020)."""
    return 0.5 * (log_prob - ref_log_prob).square()


@kl_estimator("k3", "low_var_kl")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref − logp) − (ref − logp) − 1 (Schulman 2020).

    The log-ratio is clamped to ±20 before ``exp`` only to keep a pathological token from
    producing inf; no realistic log-ratio is affected.  The estimate itself is not clamped
    (verl's ``low_var_kl`` clamps it to [−10, 10]): a token far from the reference keeps its
    gradient.
    """
    log_ratio = (ref_log_prob - log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_penalty(
    log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token KL estimate with the estimator registered as ``estimator``."""
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)} and ref_log_prob {tuple(ref_log_prob.shape)} "
            "must have the same shape"
        )
    return get_kl_estimator(estimator)(log_prob, ref_log_prob)


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index [B] of the last valid token of each row; a row with no valid token is an error."""
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(response_mask != 0, positions, -1).amax(dim=-1)
    empty = (last < 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} of response_mask have no valid token to put a score on")
    return last


def token_level_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    allow_empty: bool = False,
) -> torch.Tensor:
    """Per-token rewards [B, T]: r_t = −β·KL_t, plus the sequence score on the last valid token.

    This is the KL-in-reward shaping of Ziegler et al. 2019 (and InstructGPT, Ouyang et al.
    2022): the reward model judges the whole response, so its score lands where the response
    ends, while the KL penalty is paid token by token.  Padding gets 0.  A row without valid
    tokens is an error unless ``allow_empty`` (samples deliberately left out of the loss: a
    failed agent run, a filtered truncated response): such a row gets no reward at all.
    """
    if response_mask.ndim != 2 or scores.shape != response_mask.shape[:1]:
        raise ValueError(
            f"scores {tuple(scores.shape)} must be [B] for a response_mask [B, T], "
            f"got mask {tuple(response_mask.shape)}"
        )
    valid = response_mask != 0
    dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    rewards = torch.zeros(response_mask.shape, dtype=dtype, device=response_mask.device)
    if kl is not None:
        if kl.shape != response_mask.shape:
            raise ValueError(f"kl {tuple(kl.shape)} must match response_mask shape")
        rewards = torch.where(valid, -kl_coef * kl.to(dtype), rewards)
    if allow_empty:
        positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
        last = torch.where(valid, positions, -1).amax(dim=-1)
    else:
        last = last_valid_index(response_mask)
    on_last = torch.nn.functional.one_hot(last.clamp(min=0), response_mask.shape[-1]).to(dtype)
    on_last = on_last * (last >= 0).to(dtype)[:, None]
    return rewards + on_last * scores.to(dtype)[:, None]


def apply_kl_penalty(
    scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
    allow_empty: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-penalised token-level rewards and the KL observed, for logging and the controller.

    Metrics: ``kl/token_mean`` (per-token KL averaged within each response, then over the batch,
    the quantity verl feeds its adaptive controller), ``kl/sequence_sum`` (KL summed over each
    response, then averaged: the sequence-level KL that Ziegler et al.'s target refers to) and
    ``kl/coef``.  Feed the controller whichever one your ``target_kl`` is expressed in.
    """
    with torch.no_grad():
        kl = kl_penalty(log_prob, ref_log_prob, estimator)
        rewards = token_level_rewards(
            scores, response_mask, kl=kl, kl_coef=kl_coef, allow_empty=allow_empty
        )
        metrics = {
            "kl/token_mean": float(masked_mean(kl, response_mask, dim=-1).mean()),
            "kl/sequence_sum": float(masked_sum(kl, response_mask, dim=-1).mean()),
            "kl/coef": float(kl_coef),
        }
    return rewards, metrics


class KLController(Protocol):
    """Owns β, the KL coefficient; ``update`` is called once per training step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedKLController:
    """A constant β (Ziegler et al. 2019 use this for most of their runs)."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


class AdaptiveKLController:
    """β adapted towards a target KL (Ziegler et al. 2019, §2.2, eq. for β_{t+1}).

    e = clip(KL_now / KL_target − 1, −0.2, 0.2);  β ← β · (1 + e · n_steps / horizon).

    The proportional error is clipped so one noisy batch moves β by at most 20 % of the
    per-horizon rate; ``n_steps`` is how many samples this update accounts for (the batch size)
    so the adaptation speed does not depend on how the samples are batched.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value}, target_kl={self.target_kl}, "
            f"horizon={self.horizon})"
        )


def make_kl_controller(
    kind: str = "fixed",
    *,
    kl_coef: float,
    target_kl: float | None = None,
    horizon: float | None = None,
) -> FixedKLController | AdaptiveKLController:
    """Build a controller from config: ``kind`` is "fixed" or "adaptive"."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; available: adaptive, fixed")
