"""The policy loss core hands to training engines: on-policy without a recompute."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hf_core.batch import Batch
from hf_core.config import AlgorithmConfig, TrainerConfig
from hf_core.roles.losses import (
    MISMATCH_MAX,
    MISMATCH_SUM,
    MISMATCH_TOKENS,
    PolicyLoss,
    RolloutISMode,
    rollout_is_cap,
    rollout_is_mode,
    rollout_is_weights,
)


def _micro_batch(with_old: bool) -> tuple[dict[str, torch.Tensor], Batch]:
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    log_probs = (-2.0 + torch.randn(2, 4, generator=gen)).requires_grad_()
    rollout = log_probs.detach() + torch.tensor([[1e-3, -2e-3, 0.0, 9.0], [0.0, 5e-3, 9.0, 9.0]])
    tensors = {
        "response_mask": mask,
        "advantages": torch.randn(2, 4, generator=gen),
        "rollout_log_probs": rollout,
    }
    if with_old:
        tensors["old_log_probs"] = log_probs.detach().clone()
    mb = Batch(tensors, meta={"dp_size": 1, "global_response_tokens": 5, "global_batch_size": 2})
    return {"log_probs": log_probs, "entropy": torch.ones(2, 4)}, mb


def test_on_policy_loss_equals_the_recomputed_one_and_measures_the_mismatch() -> None:
    loss_fn = PolicyLoss(AlgorithmConfig())
    outputs, recomputed = _micro_batch(with_old=True)
    loss_a, metrics_a = loss_fn(outputs, recomputed)
    (grad_a,) = torch.autograd.grad(loss_a, outputs["log_probs"])

    outputs, on_policy = _micro_batch(with_old=False)
    loss_b, metrics_b = loss_fn(outputs, on_policy)
    (grad_b,) = torch.autograd.grad(loss_b, outputs["log_probs"])

    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert metrics_b["pg_clipfrac"] == 0.0  # ratio exactly 1
    # |training - rollout| over the 5 response tokens only (masked-out 9.0s ignored)
    assert metrics_b[MISMATCH_TOKENS] == 5.0
    assert abs(metrics_b[MISMATCH_SUM] - 8e-3) < 1e-6
    assert abs(metrics_b[MISMATCH_MAX] - 5e-3) < 1e-6
    assert MISMATCH_SUM not in metrics_a  # a recompute measures it on the driver instead


# ------------------------------------------------------- per-sequence rollout correction
def _is_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training (old) and rollout log-probs with a per-row gap, a ragged mask with an empty
    row and a full-length (truncated) row, and NaN in the padding."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [4, 0, 8, 1, 6, 8]
    mask = torch.tensor([[1.0] * n + [0.0] * (8 - n) for n in lengths], dtype=torch.float64)
    rollout = -1.0 + 0.5 * torch.randn(6, 8, generator=gen, dtype=torch.float64)
    gap = 0.4 * torch.randn(6, 1, generator=gen, dtype=torch.float64)
    old = rollout + gap + 0.1 * torch.randn(6, 8, generator=gen, dtype=torch.float64)
    return torch.where(mask != 0, old, math.nan), rollout, mask


def _row_log_ratios(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> list[tuple[int, list[int], float]]:
    """(row, valid columns, Σ log(old / rollout) over them) of each non-empty row."""
    rows = [(i, [t for t in range(mask.shape[1]) if mask[i, t]]) for i in range(mask.shape[0])]
    return [
        (i, cols, sum(float(old[i, t] - rollout[i, t]) for t in cols)) for i, cols in rows if cols
    ]


def _on_valid_tokens(
    mask: torch.Tensor, rows: list[tuple[int, list[int], float]], values: list[float]
) -> torch.Tensor:
    """Each row's value on its valid tokens, zero elsewhere: the weights a mode should give."""
    expected = torch.zeros_like(mask)
    for (i, cols, _), value in zip(rows, values, strict=True):
        expected[i, cols] = value
    return expected


def _sequence_case(
    seed: int, cap: float, mode: RolloutISMode
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor, list[tuple[int, list[int], float]]]:
    """The weights and metrics of ``mode`` on the seed's inputs, their mask and the rows' log
    ratios to check them against."""
    old, rollout, mask = _is_inputs(seed)
    weights, metrics = rollout_is_weights(old, rollout, mask, cap, mode=mode)
    return weights, metrics, mask, _row_log_ratios(old, rollout, mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seq_truncated_weights_are_the_capped_product_of_token_ratios(seed: int) -> None:
    cap = 2.0
    weights, metrics, mask, rows = _sequence_case(seed, cap, "seq_truncated")
    ratios = [(math.exp(log_ratio), len(cols)) for _, cols, log_ratio in rows]
    torch.testing.assert_close(
        weights, _on_valid_tokens(mask, rows, [min(r, cap) for r, _ in ratios])
    )
    tokens = sum(n for _, n in ratios)
    assert 0 < sum(r > cap for r, _ in ratios) < len(ratios)  # some, not all, are truncated
    assert metrics["is_seq_clip_frac"] == pytest.approx(
        sum(r > cap for r, _ in ratios) / len(ratios)
    )
    assert metrics["is_clip_frac"] == pytest.approx(sum(n for r, n in ratios if r > cap) / tokens)
    assert metrics["is_weight_max"] == pytest.approx(max(r for r, _ in ratios))
    assert metrics["is_weight_mean"] == pytest.approx(
        sum(min(r, cap) * n for r, n in ratios) / tokens
    )
    assert metrics["is_masked_frac"] == metrics["is_seq_masked_frac"] == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seq_masked_drops_sequences_whose_geometric_mean_ratio_leaves_the_band(seed: int) -> None:
    cap = 1.3
    weights, metrics, mask, rows = _sequence_case(seed, cap, "seq_masked")
    kept = [1 / cap <= math.exp(log_ratio / len(cols)) <= cap for _, cols, log_ratio in rows]
    torch.testing.assert_close(weights, _on_valid_tokens(mask, rows, [float(k) for k in kept]))
    dropped = [(not keep, len(cols)) for keep, (_, cols, _) in zip(kept, rows, strict=True)]
    assert 0 < sum(d for d, _ in dropped) < len(dropped)
    assert metrics["is_seq_masked_frac"] == pytest.approx(sum(d for d, _ in dropped) / len(dropped))
    tokens = sum(n for _, n in dropped)
    assert metrics["is_masked_frac"] == pytest.approx(sum(n for d, n in dropped if d) / tokens)


def test_seq_masked_keeps_a_long_response_whose_product_ratio_is_large() -> None:
    """Ten tokens at ratio 1.2: product 6.2 (outside [1/2, 2]), geometric mean 1.2 (inside).
    The length-normalised ratio does not drop a response for being long."""
    old = torch.full((1, 10), math.log(0.6))
    rollout = torch.full((1, 10), math.log(0.5))
    mask = torch.ones(1, 10)
    masked, metrics = rollout_is_weights(old, rollout, mask, 2.0, mode="seq_masked")
    assert torch.equal(masked, torch.ones(1, 10)) and metrics["is_seq_masked_frac"] == 0.0
    truncated, metrics = rollout_is_weights(old, rollout, mask, 2.0, mode="seq_truncated")
    assert torch.allclose(truncated, torch.full((1, 10), 2.0))
    assert metrics["is_weight_max"] == pytest.approx(1.2**10, rel=1e-5)


@pytest.mark.parametrize("mode", ["seq_truncated", "seq_masked"])
def test_sequence_weights_of_an_all_padding_batch(mode: RolloutISMode) -> None:
    weights, metrics = rollout_is_weights(
        torch.full((2, 3), math.nan), torch.zeros(2, 3), torch.zeros(2, 3), 2.0, mode=mode
    )
    assert torch.equal(weights, torch.zeros(2, 3))
    assert metrics["is_weight_mean"] == 1.0 and metrics["is_seq_masked_frac"] == 0.0


def test_policy_loss_with_seq_masked_zeroes_the_dropped_sequence_only() -> None:
    """Row 0 drifts (geometric-mean ratio 3 > cap 2): its gradient vanishes; row 1 keeps the
    uncorrected gradient."""
    log_probs = torch.log(torch.tensor([[0.6, 0.6, 0.5], [0.3, 0.4, 0.5]])).requires_grad_()
    rollout = torch.log(torch.tensor([[0.2, 0.2, 1.0], [0.3, 0.4, 1.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    tensors = {"response_mask": mask, "advantages": torch.ones(2, 3), "rollout_log_probs": rollout}
    meta = {"dp_size": 1, "global_response_tokens": 4, "global_batch_size": 2}
    loss, metrics = PolicyLoss(AlgorithmConfig(), is_cap=2.0, is_mode="seq_masked")(
        {"log_probs": log_probs}, Batch(tensors, meta=meta)
    )
    (grad,) = torch.autograd.grad(loss, log_probs)
    # On-policy ratio 1: d(-A w r)/d logp = -w / 4 tokens.
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0, 0.0], [-0.25, -0.25, 0.0]]))
    assert metrics["is_seq_masked_frac"] == 0.5


@pytest.mark.parametrize("mode", ["seq_truncated", "seq_masked"])
def test_the_config_selects_the_sequence_modes(tmp_path: Path, mode: str) -> None:
    config = TrainerConfig.model_validate(
        {
            "model": {"path": tmp_path},
            "reward": {"function": "digits_reverse"},
            "algorithm": {"rollout_is": mode, "rollout_is_cap": 3.0},
        }
    )
    assert rollout_is_mode(config) == mode
    assert rollout_is_cap(config) == 3.0
