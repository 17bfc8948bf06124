"""Between core's padded tensors and vLLM's ragged token lists.

vLLM takes each prompt as its own list of ids (no padding) and returns each completion as a
list of ids plus, per token, a ``{token_id: Logprob}`` dict.  Core's batches are rectangular:
left-padded prompts in, responses right-padded to ``max_new_tokens`` out, so batches from
different ranks concatenate (core's :mod:`hf_core.engines.decoding` does the padding).
Nothing here imports vLLM (completions are duck-typed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_core.engines import pack_responses, strip_left_padding  # noqa: F401  (re-exported)


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
    """``responses``, ``rollout_log_probs`` and ``response_mask``, right-padded (vLLM keeps the
    stop token in ``token_ids``; it is masked in, as by the transformers rollout engine)."""
    return pack_responses(
        [list(c.token_ids) for c in completions],
        [sampled_log_probs(c) for c in completions],
        max_new_tokens,
        pad_token_id,
        dtype,
        source="vLLM",
    )
