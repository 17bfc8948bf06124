"""Between core's padded tensors and SGLang's ragged token lists.

SGLang's offline engine takes each prompt as its own list of ids (no padding) and returns, per
request, a dict with ``output_ids`` and ``meta_info["output_token_logprobs"]`` (one
``(logprob, token_id, text)`` triple per generated token).  Core's batches are rectangular:
left-padded prompts in, responses right-padded to ``max_new_tokens`` out, so batches from
different ranks concatenate.  Nothing here imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def sampled_log_probs(output: Mapping[str, Any]) -> list[float]:
    """The log-prob of each generated token of one SGLang output (checked against the ids)."""
    entries = output.get("meta_info", {}).get("output_token_logprobs")
    if entries is None:
        raise RuntimeError("SGLang returned no log-probs (the request must set return_logprob)")
    tokens = list(output["output_ids"])
    if len(entries) != len(tokens):
        raise RuntimeError(f"SGLang returned {len(entries)} log-probs for {len(tokens)} tokens")
    values = []
    for (logprob, token, *_), expected in zip(entries, tokens, strict=True):
        if int(token) != int(expected):
            raise RuntimeError(f"SGLang log-prob entry is for token {token}, output has {expected}")
        values.append(float(logprob))
    return values


def pack_outputs(
    outputs: Sequence[Mapping[str, Any]], max_new_tokens: int, pad_token_id: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``responses``, ``rollout_log_probs`` and ``response_mask``, right-padded.

    The mask is 1 for every generated token, the stop token included (SGLang keeps it in
    ``output_ids``), matching the HF rollout engine.
    """
    rows = len(outputs)
    responses = torch.full((rows, max_new_tokens), pad_token_id, dtype=dtype)
    log_probs = torch.zeros(rows, max_new_tokens, dtype=torch.float32)
    mask = torch.zeros(rows, max_new_tokens, dtype=torch.long)
    for row, output in enumerate(outputs):
        tokens = list(output["output_ids"])
        if len(tokens) > max_new_tokens:
            raise RuntimeError(f"SGLang returned {len(tokens)} tokens, asked for {max_new_tokens}")
        length = len(tokens)
        if length:
            responses[row, :length] = torch.tensor(tokens, dtype=dtype)
            log_probs[row, :length] = torch.tensor(sampled_log_probs(output))
            mask[row, :length] = 1
    return responses, log_probs, mask
