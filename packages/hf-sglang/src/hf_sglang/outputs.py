"""Between core's padded tensors and SGLang's ragged token lists.

SGLang's offline engine takes each prompt as its own list of ids (no padding) and returns, per
request, a dict with ``output_ids`` and ``meta_info["output_token_logprobs"]`` (one
``(logprob, token_id, text)`` triple per generated token).  Core's batches are rectangular:
left-padded prompts in, responses right-padded to ``max_new_tokens`` out, so batches from
different ranks concatenate (core's :mod:`hf_core.engines.decoding` does the padding).
Nothing here imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hf_core.engines import pack_responses, strip_left_padding  # noqa: F401  (re-exported)


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
    """``responses``, ``rollout_log_probs`` and ``response_mask``, right-padded (SGLang keeps
    the stop token in ``output_ids``; it is masked in, as by the transformers rollout engine)."""
    tokens = [list(output["output_ids"]) for output in outputs]
    for row in tokens:  # before reading log-probs: a too-long output is the clearer error
        if len(row) > max_new_tokens:
            raise RuntimeError(f"SGLang returned {len(row)} tokens, asked for {max_new_tokens}")
    log_probs = [sampled_log_probs(output) for output in outputs]
    return pack_responses(tokens, log_probs, max_new_tokens, pad_token_id, dtype, source="SGLang")
