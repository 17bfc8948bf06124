"""Core's backend-neutral :class:`SamplingParams` -> SGLang's per-request sampling dicts.

Log-probs: with ``return_logprob=True`` SGLang returns, for each sampled token,
``log_softmax(logits / temperature)`` over the full vocabulary (top-k / top-p only choose which
tokens may be drawn; they do not renormalise the returned log-probs), and the raw
``log_softmax(logits)`` when greedy -- exactly the quantity the training engine recomputes, so
no temperature correction is needed (``hf_sglang.runtime`` forces
``SGLANG_RETURN_ORIGINAL_LOGPROB`` off, which would return raw log-probs; the tests check
the match against the training engine at temperature != 1).

Seeds: sampling runs in SGLang's scheduler process with its own RNG (seeded by the engine's
``seed``), so rollouts never disturb the trainer's RNG.  ``SamplingParams.seed`` becomes a
per-request ``sampling_seed``, which SGLang honours when the engine runs with
``enable_deterministic_inference`` (``engine_kwargs``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from hf_core.engines import SamplingParams

SEED_BITS = 62


def request_seed(base: int, index: int) -> int:
    """A well-mixed seed for request ``index`` of a call seeded with ``base``."""
    digest = hashlib.blake2b(f"{base}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def sglang_sampling_params(
    params: SamplingParams, stop_token_ids: Sequence[int], ignore_eos: bool
) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict shared by every request of a call.

    ``stop_token_ids`` already includes the model's EOS ids (SGLang also stops on the EOS ids
    of the model's config, the same ones).  ``ignore_eos`` makes SGLang skip every stop-token
    check, so every response has exactly ``max_new_tokens`` tokens (benchmarks).
    """
    return {
        "n": 1,  # the engine repeats each prompt n times itself (consecutive rows)
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": 1.0 if params.greedy else params.top_p,
        "top_k": -1 if params.greedy or params.top_k <= 0 else params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": [] if ignore_eos else sorted(set(stop_token_ids)),
        "ignore_eos": ignore_eos,
        "skip_special_tokens": False,
    }


def request_params(
    params: SamplingParams, count: int, *, stop_token_ids: Sequence[int], ignore_eos: bool
) -> list[dict[str, Any]]:
    """One sampling dict per request (they differ only in ``sampling_seed``, when seeded)."""
    shared = sglang_sampling_params(params, stop_token_ids, ignore_eos)
    if params.seed is None or params.greedy:
        return [dict(shared) for _ in range(count)]
    return [{**shared, "sampling_seed": request_seed(params.seed, i)} for i in range(count)]
