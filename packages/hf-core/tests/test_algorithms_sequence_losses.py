"""GSPO, GSPO-token and CISPO against plain per-sequence / per-token loops of the papers' formulas.

* GSPO — Zheng et al. 2025, arXiv 2507.18071 §4.1: s_i = exp(mean_t log(π/π_old)),
  loss = 1/G Σ_i −min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i).
* GSPO-token — §4.3: s_{i,t} = sg[s_i]·π_t/sg[π_t]; gradient −A_{i,t}·s_i·∇log π_t per token
  (unless the clip is active), mean over the row's tokens, then over rows.
* CISPO — MiniMax-M1, arXiv 2506.13585 §3.1: −sg(clip(r_t, 1−ε_low, 1+ε_high))·A_t·log π_t,
  token-mean.

The references below loop over rows and tokens in Python and take gradients analytically (or
by autograd through the plain formula), so they share no code with the implementation.
"""

from __future__ import annotations

import math

import pytest
import torch
from float64 import D

from hf_core.algorithms import (
    PolicyLossConfig,
    cispo_loss,
    get_policy_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
)

B, T = 6, 7
LENGTHS = [3, 7, 0, 5, 1, 7]  # row 2 empty; rows 1 and 5 fill T (cut at the length limit)


def _inputs(seed: int, shift: float = 0.3) -> dict[str, torch.Tensor]:
    """Random log-probs with a per-row drift (so some sequences clip), a ragged mask with an
    empty row and full-length rows, and NaN/inf garbage in the padding."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS], dtype=D)
    old = -1.5 + 0.5 * torch.randn(B, T, generator=gen, dtype=D)
    drift = shift * torch.randn(B, 1, generator=gen, dtype=D)
    new = old + drift + 0.05 * torch.randn(B, T, generator=gen, dtype=D)
    adv = torch.randn(B, T, generator=gen, dtype=D)
    padding = mask == 0
    new = torch.where(padding, torch.full_like(new, math.nan), new)
    old = torch.where(padding, torch.full_like(old, -math.inf), old)
    adv = torch.where(padding, torch.full_like(adv, math.inf), adv)
    return {"log_prob": new, "old_log_prob": old, "advantages": adv, "response_mask": mask}


def _rows(mask: torch.Tensor) -> list[tuple[int, list[int]]]:
    """(row, valid columns) of every non-empty row."""
    out = []
    for i in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if mask[i, t] != 0]
        if cols:
            out.append((i, cols))
    return out


def _clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


# ------------------------------------------------------------------------------------ GSPO
def reference_gspo(
    inputs: dict[str, torch.Tensor], config: PolicyLossConfig
) -> tuple[float, torch.Tensor, float]:
    """Loss, d loss / d log_prob and clipped-token share, one sequence at a time.

    Sequence loss l_i = −min(s_i A_i, clip(s_i) A_i).  Its gradient wrt log π_{i,t} is
    −A_i·s_i/|y_i| where the unclipped term is the minimum, else 0.  Aggregation:
    seq-mean-token-mean = mean_i l_i; token-mean = Σ_i |y_i| l_i / Σ_i |y_i|.
    """
    low, high = 1 - config.clip_ratio_low, 1 + config.clip_ratio_high
    lp, olp, adv = inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"]
    mask = inputs["response_mask"]
    rows = _rows(mask)
    n_tokens = sum(len(cols) for _, cols in rows)
    grad = torch.zeros_like(lp)
    losses, weights, clipped_tokens = [], [], 0
    for i, cols in rows:
        n = len(cols)
        s = math.exp(sum(float(lp[i, t] - olp[i, t]) for t in cols) / n)
        a = sum(float(adv[i, t]) for t in cols) / n
        unclipped, clipped = s * a, _clip(s, low, high) * a
        losses.append(-min(unclipped, clipped))
        active_clip = clipped < unclipped
        clipped_tokens += n if active_clip else 0
        weight = 1 / len(rows) if config.loss_agg_mode == "seq-mean-token-mean" else n / n_tokens
        weights.append(weight)
        for t in cols:
            grad[i, t] = 0.0 if active_clip else -a * s / n * weight
    loss = sum(w * x for w, x in zip(weights, losses, strict=True))
    return loss, grad, clipped_tokens / n_tokens


SEQ_MEAN = "seq-mean-token-mean"
CONFIGS = [
    PolicyLossConfig(loss_agg_mode=SEQ_MEAN),
    PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean"),
    # The GSPO paper's ranges (§5.1): nearly every off-policy sequence is clipped.
    PolicyLossConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode=SEQ_MEAN),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_value_gradient_and_clipfrac_match_a_per_sequence_loop(
    config: PolicyLossConfig, seed: int
) -> None:
    inputs = _inputs(seed)
    expected_loss, expected_grad, expected_clipfrac = reference_gspo(inputs, config)
    log_prob = inputs["log_prob"].clone().requires_grad_()
    loss, metrics = gspo_loss(**{**inputs, "log_prob": log_prob}, config=config)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert metrics["pg_clipfrac"] == pytest.approx(expected_clipfrac)
    assert metrics["pg_loss"] == pytest.approx(expected_loss, rel=1e-10, abs=1e-12)


def test_the_random_inputs_exercise_both_sides_of_the_clip() -> None:
    """Guards the test above: with ε = 0.2 some sequences are clipped and some are not."""
    fracs = [reference_gspo(_inputs(seed), CONFIGS[0])[2] for seed in range(3)]
    assert any(0 < f < 1 for f in fracs)


def test_gspo_token_with_constant_advantages_equals_gspo_in_value_and_gradient() -> None:
    """The paper's §4.3 remark: with A_{i,t} = A_i the two objectives coincide."""
    inputs = _inputs(3)
    mask = inputs["response_mask"]
    per_row = torch.randn(B, 1, dtype=D, generator=torch.Generator().manual_seed(9))
    inputs["advantages"] = torch.where(mask != 0, per_row.expand(B, T), math.inf)
    config = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean")
    results = []
    for fn in (gspo_loss, gspo_token_loss):
        log_prob = inputs["log_prob"].clone().requires_grad_()
        loss, _ = fn(**{**inputs, "log_prob": log_prob}, config=config)
        results.append((loss, *torch.autograd.grad(loss, log_prob)))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


def reference_gspo_token(
    inputs: dict[str, torch.Tensor], config: PolicyLossConfig
) -> tuple[float, torch.Tensor]:
    """seq-mean-token-mean of −min(s_i A_{i,t}, clip(s_i) A_{i,t}); gradient per token
    −A_{i,t}·s_i/(G·|y_i|) unless the clipped term is the minimum for that token."""
    low, high = 1 - config.clip_ratio_low, 1 + config.clip_ratio_high
    lp, olp, adv = inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"]
    rows = _rows(inputs["response_mask"])
    grad = torch.zeros_like(lp)
    loss = 0.0
    for i, cols in rows:
        n = len(cols)
        s = math.exp(sum(float(lp[i, t] - olp[i, t]) for t in cols) / n)
        for t in cols:
            a = float(adv[i, t])
            unclipped, clipped = s * a, _clip(s, low, high) * a
            loss += -min(unclipped, clipped) / n / len(rows)
            grad[i, t] = 0.0 if clipped < unclipped else -a * s / n / len(rows)
    return loss, grad


@pytest.mark.parametrize("seed", [0, 4])
def test_gspo_token_uses_per_token_advantages(seed: int) -> None:
    inputs = _inputs(seed)
    config = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean")
    expected_loss, expected_grad = reference_gspo_token(inputs, config)
    log_prob = inputs["log_prob"].clone().requires_grad_()
    loss, _ = gspo_token_loss(**{**inputs, "log_prob": log_prob}, config=config)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    # Not GSPO: with varying advantages in a row the two differ.
    gspo_value, _ = gspo_loss(**inputs, config=config)
    assert abs(gspo_value.item() - expected_loss) > 1e-6


def test_gspo_on_policy_is_grpo_with_sequence_mean() -> None:
    """Ratio 1 everywhere: GSPO's gradient is −A_i/(G|y_i|) per token, PPO-clip's under
    seq-mean-token-mean with the row's advantage on every token."""
    inputs = _inputs(5)
    mask = inputs["response_mask"]
    inputs["old_log_prob"] = torch.where(mask != 0, inputs["log_prob"], -math.inf)
    per_row = torch.randn(B, 1, dtype=D, generator=torch.Generator().manual_seed(2))
    inputs["advantages"] = torch.where(mask != 0, per_row.expand(B, T), 0.0)
    config = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean")
    results = []
    for fn in (gspo_loss, ppo_clip_loss):
        log_prob = inputs["log_prob"].clone().requires_grad_()
        loss, metrics = fn(**{**inputs, "log_prob": log_prob}, config=config)
        results.append((loss, *torch.autograd.grad(loss, log_prob)))
        assert metrics["pg_clipfrac"] == 0.0
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "cispo"])
def test_zero_advantages_give_zero_loss_and_gradient(name: str) -> None:
    """A group whose rewards all agree has advantage 0 on every token: no signal."""
    inputs = _inputs(6)
    inputs["advantages"] = torch.zeros(B, T, dtype=D)
    log_prob = inputs["log_prob"].clone().requires_grad_()
    loss, _ = get_policy_loss(name)(**{**inputs, "log_prob": log_prob})
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "cispo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_empty_rows_and_padding_garbage_change_nothing(name: str, mode: str) -> None:
    """Dropping the empty row (and the padding's NaN/inf) gives the same loss and gradients."""
    inputs = _inputs(7)
    config = PolicyLossConfig(loss_agg_mode=mode)
    log_prob = inputs["log_prob"].clone().requires_grad_()
    loss, _ = get_policy_loss(name)(**{**inputs, "log_prob": log_prob}, config=config)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(
        grad[inputs["response_mask"] == 0], torch.zeros(B * T - sum(LENGTHS), dtype=D)
    )

    keep = [i for i, n in enumerate(LENGTHS) if n]
    mask = inputs["response_mask"][keep]
    clean = {k: torch.where(mask != 0, v[keep], 0.0) for k, v in inputs.items()}
    clean["response_mask"] = mask
    log_prob_clean = clean["log_prob"].clone().requires_grad_()
    loss_clean, _ = get_policy_loss(name)(**{**clean, "log_prob": log_prob_clean}, config=config)
    (grad_clean,) = torch.autograd.grad(loss_clean, log_prob_clean)
    torch.testing.assert_close(loss, loss_clean)
    torch.testing.assert_close(grad[keep], grad_clean)


def test_all_padding_batch_gives_zero() -> None:
    zeros = torch.zeros(2, 3, dtype=D)
    for name in ("gspo", "gspo_token", "cispo"):
        loss, _ = get_policy_loss(name)(zeros, zeros, zeros, zeros)
        assert loss.item() == 0.0


# ----------------------------------------------------------------------------------- CISPO
def reference_cispo(
    inputs: dict[str, torch.Tensor], config: PolicyLossConfig
) -> tuple[float, torch.Tensor, float, float]:
    """Token-mean of −sg(clip(r)) A log π, its gradient −clip(r)·A/N, clipped share, mean k1."""
    low, high = 1 - config.clip_ratio_low, 1 + config.clip_ratio_high
    lp, olp, adv = inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"]
    cells = [(i, t) for i, cols in _rows(inputs["response_mask"]) for t in cols]
    n = len(cells)
    grad = torch.zeros_like(lp)
    loss = clipped = kl = 0.0
    for i, t in cells:
        r = math.exp(float(lp[i, t] - olp[i, t]))
        w = _clip(r, low, high)
        loss += -w * float(adv[i, t]) * float(lp[i, t]) / n
        grad[i, t] = -w * float(adv[i, t]) / n
        clipped += (r < low or r > high) / n
        kl += float(olp[i, t] - lp[i, t]) / n
    return loss, grad, clipped, kl


@pytest.mark.parametrize(
    "config",
    [
        PolicyLossConfig(),
        PolicyLossConfig(clip_ratio_low=1.0, clip_ratio_high=0.28),  # the paper: no lower bound
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_value_gradient_and_metrics_match_a_per_token_loop(
    config: PolicyLossConfig, seed: int
) -> None:
    inputs = _inputs(seed, shift=0.5)
    expected_loss, expected_grad, expected_clipfrac, expected_kl = reference_cispo(inputs, config)
    assert 0 < expected_clipfrac < 1  # both sides of the clip are exercised
    log_prob = inputs["log_prob"].clone().requires_grad_()
    loss, metrics = cispo_loss(**{**inputs, "log_prob": log_prob}, config=config)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert metrics["pg_clipfrac"] == pytest.approx(expected_clipfrac)
    assert metrics["ppo_kl"] == pytest.approx(expected_kl)
    assert metrics["pg_loss"] == pytest.approx(expected_loss, rel=1e-10)


def test_cispo_keeps_gradients_where_ppo_clip_drops_them() -> None:
    """Ratio 1.5 with A > 0 is clipped: PPO's gradient is 0 there, CISPO's is −1.2·A/N."""
    log_prob = torch.log(torch.tensor([[1.5, 1.0]], dtype=D)).requires_grad_()
    old = torch.zeros(1, 2, dtype=D)
    adv = torch.ones(1, 2, dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    (ppo_grad,) = torch.autograd.grad(ppo_clip_loss(log_prob, old, adv, mask)[0], log_prob)
    (cispo_grad,) = torch.autograd.grad(cispo_loss(log_prob, old, adv, mask)[0], log_prob)
    torch.testing.assert_close(ppo_grad, torch.tensor([[0.0, -0.5]], dtype=D))
    torch.testing.assert_close(cispo_grad, torch.tensor([[-0.6, -0.5]], dtype=D))


def test_new_policy_losses_are_registered() -> None:
    assert get_policy_loss("gspo") is gspo_loss
    assert get_policy_loss("gspo_token") is gspo_token_loss
    assert get_policy_loss("cispo") is cispo_loss


def test_clip_ratio_low_of_one_means_no_lower_bound_and_above_is_rejected() -> None:
    assert PolicyLossConfig(clip_ratio_low=1.0).clip_ratio_low == 1.0
    with pytest.raises(ValueError, match="less than or equal to 1"):
        PolicyLossConfig(clip_ratio_low=1.5)
