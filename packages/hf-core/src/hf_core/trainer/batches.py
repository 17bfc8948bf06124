"""Batch helpers of the trainer: SFT examples, sampling parameters, token counting."""

from __future__ import annotations

from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.config import RolloutConfig
from hf_core.engines import SamplingParams

PROMPT_TENSORS = ("input_ids", "attention_mask")


def sampling_params(
    rollout: RolloutConfig, step: int, seed: int, *, greedy: bool = False, n: int | None = None
) -> SamplingParams:
    """Per-step seeded sampling, so a resumed run draws exactly what a straight run would."""
    return SamplingParams(
        temperature=0.0 if greedy else rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        n=1 if greedy else (n or rollout.n),
        stop_token_ids=tuple(rollout.stop_token_ids),
        seed=seed * 1_000_003 + step,
    )


def sft_batch(prompts: Batch, tokenizer: Any) -> Batch:
    """Prompt -> ground truth as a rollout-shaped batch whose 'response' is the target."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    targets = [
        tokenizer(str(truth), add_special_tokens=False)["input_ids"]
        + ([eos] if eos is not None else [])
        for truth in prompts["ground_truth"]
    ]
    width = max(len(t) for t in targets)
    responses = torch.full((len(targets), width), pad, dtype=torch.long)
    response_mask = torch.zeros((len(targets), width), dtype=torch.long)
    for i, ids in enumerate(targets):
        responses[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = 1
    attention = torch.cat([prompts["attention_mask"], response_mask], dim=1)
    return Batch(
        {
            "prompts": prompts["input_ids"],
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts["input_ids"], responses], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        }
    )


def token_count(batch: Batch) -> int:
    """Prompt + response tokens (the paper's throughput counts both)."""
    return int(batch["attention_mask"].sum())
