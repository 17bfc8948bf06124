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
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs
