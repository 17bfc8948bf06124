"""Token selection shared by rollout engines that sample in Python: temperature, top-k, top-p.

Log-probs are always of ``softmax(logits / temperature)`` over the full vocabulary (raw
logits when greedy), the quantity a training engine recomputes; top-k / top-p only decide
which tokens may be drawn.
"""

from __future__ import annotations

import torch

from hf_core.engines.rollout import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf (keeps at least one token)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` by inverse-CDF sampling: one uniform number per row.

    The same distribution as ``torch.multinomial(probs, 1)``, which draws a random number per
    vocabulary entry and was the largest single cost of a small model's decode step on CPU.
    A zero-probability token is never drawn: its CDF step is empty and ``u`` lies in (0, 1].
    """
    cdf = probs.cumsum(-1)
    u = 1.0 - torch.rand(
        (*probs.shape[:-1], 1), generator=generator, device=probs.device, dtype=cdf.dtype
    )
    tokens = torch.searchsorted(cdf, u * cdf[..., -1:]).squeeze(-1)
    return tokens.clamp(max=probs.shape[-1] - 1)  # rounding at the very top of the CDF


def select_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens ``[B]`` and their log-probs under the sampling distribution."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
        scaled = logits
    else:
        scaled = logits / params.temperature
        filtered = filter_logits(scaled, params.top_k, params.top_p)
        tokens = draw(torch.softmax(filtered, dim=-1), generator)
    log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs
