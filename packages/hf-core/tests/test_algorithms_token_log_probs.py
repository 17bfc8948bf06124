"""The fused token log-prob / entropy node against plain autograd (float64)."""

from __future__ import annotations

import pytest
import torch

from hf_core.algorithms import entropy_from_logits, token_log_probs_and_entropy
from hf_testing.grad_checks import weighted_loss


def reference(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    return log_probs, entropy_from_logits(logits)


@pytest.mark.parametrize("use", ["log_probs", "entropy", "both"])
def test_values_and_gradients_match_plain_autograd(use: str) -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, 17, generator=gen, dtype=torch.float64) * 3
    tokens = torch.randint(0, 17, (3, 5), generator=gen)
    weights = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    results = []
    for fn in (reference, token_log_probs_and_entropy):
        logits = base.clone().requires_grad_()
        log_probs, entropy = fn(logits, tokens)
        assert entropy is not None
        weighted_loss(log_probs, entropy, weights, use).backward()
        results.append((log_probs.detach(), entropy.detach(), logits.grad))
    for ours, theirs in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


def test_without_entropy_returns_none_and_the_same_log_probs() -> None:
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1), requires_grad=True)
    tokens = torch.tensor([0, 3, 8, 3])
    log_probs, entropy = token_log_probs_and_entropy(logits, tokens, with_entropy=False)
    assert entropy is None
    expected = torch.log_softmax(logits.detach(), -1)[torch.arange(4), tokens]
    torch.testing.assert_close(log_probs.detach(), expected)
    log_probs.sum().backward()
    assert logits.grad is not None
    onehot = torch.nn.functional.one_hot(tokens, 9).float()
    torch.testing.assert_close(logits.grad, onehot - torch.softmax(logits.detach(), -1))


def test_an_unused_output_costs_no_gradient() -> None:
    """Entropy as a metric only: backward through the log-probs alone is the lp gradient."""
    logits = torch.randn(2, 6, requires_grad=True)
    tokens = torch.tensor([1, 5])
    log_probs, _entropy = token_log_probs_and_entropy(logits, tokens)
    (log_probs * torch.tensor([2.0, -1.0])).sum().backward()
    probs = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(tokens, 6).float()
    expected = (onehot - probs) * torch.tensor([[2.0], [-1.0]])
    torch.testing.assert_close(logits.grad, expected)
