"""Token selection for the megatron rollout engine: greedy, temperature, top-k, top-p.

Same conventions as core's ``SamplingParams``: log-probs are of ``softmax(logits /
temperature)`` over the whole vocabulary (raw logits when greedy), the quantity a training
engine recomputes; top-k / top-p only restrict which tokens may be drawn.
"""

from __future__ import annotations

import torch

from hf_core.engines import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf (at least one token survives)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
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
        tokens, scaled = logits.argmax(-1), logits
    else:
        scaled = logits / params.temperature
        probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, log_probs
