"""DAPO's soft overlong punishment: a length penalty added to the reward of long responses.

Source: Yu et al. 2025, "DAPO" (arXiv 2503.14476) §3.4, eq. 13.  With L_max the generation
limit (``rollout.max_new_tokens``) and L_cache a buffer before it (``algorithm.overlong.buffer``):

    R_length(y) = 0                               if |y| ≤ L_max − L_cache
                = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
                = −1                              if |y| > L_max

A response cut at the limit is not necessarily wrong, so penalising it with the full task
reward is noise; the linear ramp instead tells the policy *that* it is running long before the
cut.  The penalty is added to the task reward (scaled by ``penalty_factor``).
"""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_new_tokens: int,
    buffer: int,
    penalty_factor: float = 1.0,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``penalty_factor`` · R_length(|y|) of DAPO eq. 13 for each response length [B].

    Values lie in [−penalty_factor, 0].  ``buffer`` 0 turns the shaping off (all zeros), and
    must be below ``max_new_tokens`` (otherwise no length is penalty-free).  The result has
    ``dtype`` (default: torch's default float dtype), on the lengths' device.
    """
    if buffer < 0:
        raise ValueError(f"buffer must be >= 0, got {buffer}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    if buffer and buffer >= max_new_tokens:
        raise ValueError(f"buffer ({buffer}) must be < max_new_tokens ({max_new_tokens})")
    dtype = dtype or torch.get_default_dtype()
    lengths = response_lengths.to(dtype)
    if buffer == 0:
        return torch.zeros_like(lengths)
    free = float(max_new_tokens - buffer)
    ramp = (free - lengths) / float(buffer)
    penalty = torch.where(lengths <= free, torch.zeros_like(lengths), ramp)
    penalty = torch.where(lengths > max_new_tokens, torch.full_like(lengths, -1.0), penalty)
    return penalty * penalty_factor


def truncated_responses(
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] | list[int],
) -> torch.Tensor:
    """Per response [B]: whether generation was cut at ``max_new_tokens`` -- the response
    fills the limit and its last token is not a stop token (DAPO's overlong filtering drops
    these from the loss: their reward judges an unfinished answer)."""
    valid = response_mask != 0
    # one past the last response token (padding only ever follows the response)
    ends = torch.where(valid.any(-1), valid.shape[-1] - valid.flip(-1).long().argmax(-1), 0)
    full = ends >= max_new_tokens
    last = responses.gather(-1, (ends - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    stops = torch.tensor(list(stop_token_ids), dtype=responses.dtype, device=responses.device)
    return full & ~torch.isin(last, stops)
