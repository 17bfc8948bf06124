"""Losses that exercise a log-prob / entropy kernel's backward the way the policy loss does."""

from __future__ import annotations

from typing import Literal

import torch


def weighted_loss(
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    weights: tuple[torch.Tensor, torch.Tensor],
    use: Literal["log_probs", "entropy", "both"],
) -> torch.Tensor:
    """A float64 scalar from the log-probs, the entropy or both, each weighted per token, so
    a backward reaches the kernel through the outputs a test asks for."""
    loss = torch.zeros((), dtype=torch.float64)
    if use in ("log_probs", "both"):
        loss = loss + (log_probs * weights[0]).sum()
    if use in ("entropy", "both"):
        assert entropy is not None
        loss = loss + (entropy * weights[1]).sum()
    return loss
