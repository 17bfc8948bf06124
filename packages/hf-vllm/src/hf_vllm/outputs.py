"""Between core's padded tensors and vLLM's ragged token lists.

vLLM takes each prompt as its own list of ids (no padding) and returns each completion as a
list of ids plus, per token, a ``{token_id: Logprob}`` dict.  Core's batches are rectangular:
left-padded prompts in, responses right-padded to ``max_new_tokens`` out, so batches from
different ranks concatenate.  Nothing here imports vLLM (completions are duck-typed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real prompt tokens (those with ``attention_mask == 1``), in order."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} differ in shape"
        )
    prompts = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.bool().tolist(), strict=True):
        kept = [token for token, keep in zip(ids, mask, strict=True) if keep]
        if not kept:
            raise ValueError("a prompt has no tokens (its attention_mask is all zero)")
        prompts.append(kept)
    return prompts


def sampled_log_probs(completion: Any) -> list[float]:
    """The log-prob of each sampled token of one vLLM completion."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (the request must set logprobs=0)")
    return [
        float(step[token].logprob)
        for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


def pack_completions(
    completions: Sequence[Any], max_new_tokens: int, pad_token_id: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``responses``, ``rollout_log_probs`` and ``response_mask``, right-padded.

    The mask is 1 for every generated token, the stop token included (vLLM keeps it in
    ``token_ids``), matching the HF rollout engine.
    """
    rows = len(completions)
    responses = torch.full((rows, max_new_tokens), pad_token_id, dtype=dtype)
    log_probs = torch.zeros(rows, max_new_tokens, dtype=torch.float32)
    mask = torch.zeros(rows, max_new_tokens, dtype=torch.long)
    for row, completion in enumerate(completions):
        tokens = list(completion.token_ids)
        if len(tokens) > max_new_tokens:
            raise RuntimeError(f"vLLM returned {len(tokens)} tokens, asked for {max_new_tokens}")
        length = len(tokens)
        responses[row, :length] = torch.tensor(tokens, dtype=dtype)
        log_probs[row, :length] = torch.tensor(sampled_log_probs(completion))
        mask[row, :length] = 1
    return responses, log_probs, mask
