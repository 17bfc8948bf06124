"""Core's backend-neutral :class:`SamplingParams` -> vLLM's, with per-request seeds.

Why every request gets its own seed:

* a request without one draws from the process-global torch RNG, which in hybrid mode is the
  *training* RNG: rollouts would shift dropout masks and data order;
* under tensor parallelism (``external_launcher``) every rank of an engine samples on its own
  and must draw the same tokens; identical seeds on every rank guarantee it.

Seeds are derived from (base seed, generation-DP rank, request index), so two replicas given the
same prompt sample differently while the ranks of one TP engine agree.

Log-probs: the engine runs with ``logprobs_mode="processed_logprobs"`` and asks for the sampled
token's log-prob (``logprobs=0``): ``log_softmax(logits / temperature)``, raw logits when
greedy -- what the training engine recomputes.  With top-k / top-p active vLLM renormalises
over the kept tokens first, so those log-probs are of the truncated distribution (the batch
says so in ``meta["rollout_log_probs_truncated"]``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from hf_core.engines import SamplingParams

SEED_BITS = 62  # vLLM seeds must fit a signed 64-bit integer, with room for seed + sample index


def request_seeds(base: object, replica: int, count: int) -> list[int]:
    """``count`` well-mixed seeds for one generate call on one generation replica."""
    seeds = []
    for index in range(count):
        digest = hashlib.blake2b(f"{base}:{replica}:{index}".encode(), digest_size=8).digest()
        seeds.append(int.from_bytes(digest, "little") >> (64 - SEED_BITS))
    return seeds


def truncates(params: SamplingParams) -> bool:
    """Whether top-k / top-p narrow the distribution tokens are drawn from."""
    return not params.greedy and (params.top_k > 0 or params.top_p < 1.0)


def vllm_sampling_kwargs(
    params: SamplingParams, stop_token_ids: Sequence[int], ignore_eos: bool
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` shared by every request of a call.

    ``stop_token_ids`` already includes the model's EOS ids (the engine resolves them the way
    the transformers engine does); ``ignore_eos`` drops them all, so every response has exactly
    ``max_new_tokens`` tokens.
    """
    return {
        "n": 1,  # the engine repeats each prompt n times itself (vLLM refuses greedy n > 1)
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": 1.0 if params.greedy else params.top_p,
        "top_k": 0 if params.greedy or params.top_k <= 0 else params.top_k,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": [] if ignore_eos else sorted(set(stop_token_ids)),
        "ignore_eos": True,  # EOS handling is ours (stop_token_ids), not the tokenizer's
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
        "skip_special_tokens": False,
    }


def build_sampling_params(
    sampling_cls: Any,
    params: SamplingParams,
    *,
    stop_token_ids: Sequence[int],
    ignore_eos: bool,
    seeds: Sequence[int],
) -> list[Any]:
    """One ``vllm.SamplingParams`` per request (they differ in the seed only)."""
    shared = vllm_sampling_kwargs(params, stop_token_ids, ignore_eos)
    return [sampling_cls(seed=seed, **shared) for seed in seeds]
