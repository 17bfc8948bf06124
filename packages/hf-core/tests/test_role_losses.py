"""The policy loss core hands to training engines: on-policy without a recompute."""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_core.config import AlgorithmConfig
from hf_core.roles.losses import MISMATCH_MAX, MISMATCH_SUM, MISMATCH_TOKENS, PolicyLoss


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
