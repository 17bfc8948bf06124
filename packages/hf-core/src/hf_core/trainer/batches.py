"""Batch helpers of the trainer: SFT examples, sampling parameters, token counting, and joining
sample batches of different widths."""

from __future__ import annotations

from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.config import RolloutConfig, TrainerConfig
from hf_core.engines import SamplingParams
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, unrecorded
from hf_core.multimodal import IMAGES_KEY, MULTI_MODAL_KEY

PROMPT_TENSORS = ("input_ids", "attention_mask")


def generation_input(prompts: Batch, config: TrainerConfig) -> Batch:
    """What a rollout engine gets of a prompt batch: its tokens and images, plus the dataset
    fields when an agent function runs (``agent.function`` receives them as its ``sample``)."""
    fields = list(prompts.non_tensors) if config.runs_agent_function else []
    fields += [k for k in (MULTI_MODAL_KEY, IMAGES_KEY) if k in prompts and k not in fields]
    return prompts.select(*PROMPT_TENSORS, *fields)


RESPONSE_PAD_VALUES = {"token_versions": -1}
"""Right-padding value of response-aligned columns other than 0 (-1: no policy version)."""


def pad_samples(samples: Batch, prompt_width: int, response_width: int) -> Batch:
    """Rollout samples widened to ``prompt_width`` prompt and ``response_width`` response
    columns: prompts left-padded, responses (and every other response-aligned 2-D tensor)
    right-padded, ``input_ids`` / ``attention_mask`` both, positions recomputed."""
    left = prompt_width - samples["prompts"].shape[1]
    width = samples["responses"].shape[1]
    right = response_width - width
    if left < 0 or right < 0:
        raise ValueError(
            f"cannot narrow samples of widths ({samples['prompts'].shape[1]}, {width}) "
            f"to ({prompt_width}, {response_width})"
        )
    if not left and not right:
        return samples
    pad = torch.nn.functional.pad
    out = samples.select(*samples.keys())
    out["prompts"] = pad(samples["prompts"], (left, 0), value=0)
    for key in PROMPT_TENSORS:
        out[key] = pad(samples[key], (left, right), value=0)
    out["position_ids"] = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    if ROUTED_EXPERTS_KEY in samples:  # [rows, columns, layers, k]: columns as input_ids
        routed = samples[ROUTED_EXPERTS_KEY]
        out[ROUTED_EXPERTS_KEY] = pad(
            routed, (0, 0, 0, 0, left, right), value=unrecorded(routed.dtype)
        )
    whole_row = {"prompts", "position_ids", ROUTED_EXPERTS_KEY, *PROMPT_TENSORS}
    for key in samples.keys():
        value = samples[key]
        aligned = isinstance(value, torch.Tensor) and value.dim() == 2
        if key not in whole_row and aligned and value.shape[1] == width:
            out[key] = pad(value, (0, right), value=RESPONSE_PAD_VALUES.get(key, 0))
    return out


def concat_prompts(parts: list[Batch]) -> Batch:
    """Prompt batches (left-padded, as the loader collates them) of possibly different
    widths as one batch, in order."""
    width = max(part["input_ids"].shape[1] for part in parts)
    pad = torch.nn.functional.pad
    widened = []
    for part in parts:
        left = width - part["input_ids"].shape[1]
        if left:
            part = part.select(*part.keys())
            for key in PROMPT_TENSORS:
                part[key] = pad(part[key], (left, 0), value=0)
            if "position_ids" in part:
                part["position_ids"] = (part["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        widened.append(part)
    return Batch.concat(widened)


def concat_samples(parts: list[Batch]) -> Batch:
    """Rollout sample batches of possibly different widths as one batch (in order)."""
    prompt_width = max(part["prompts"].shape[1] for part in parts)
    response_width = max(part["responses"].shape[1] for part in parts)
    return Batch.concat([pad_samples(part, prompt_width, response_width) for part in parts])


def sampling_params(
    rollout: RolloutConfig,
    step: int,
    seed: int,
    *,
    greedy: bool = False,
    n: int | None = None,
    routed_experts: bool = False,
) -> SamplingParams:
    """Per-step seeded sampling, so a resumed run draws exactly what a straight run would;
    ``routed_experts``: the samples carry an MoE model's expert choices (routing replay)."""
    return SamplingParams(
        temperature=0.0 if greedy else rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        n=1 if greedy else (n or rollout.n),
        stop_token_ids=tuple(rollout.stop_token_ids),
        seed=seed * 1_000_003 + step,
        routed_experts=routed_experts,
    )


def _sft_target(target: Any, tokenizer: Any, eos: int | None) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one SFT target.

    A string is the response text (EOS appended, all trained on).  A list of segments
    ``{"text": ..., "train": bool}`` is a multi-turn target, each segment tokenized on its
    own as the agent loop does (a model turn writes its own stop token in its text), with
    ``train: false`` segments (tool messages) attended to but not trained on.
    """
    if not isinstance(target, (list, tuple)):
        ids = tokenizer(str(target), add_special_tokens=False)["input_ids"]
        ids = ids + ([eos] if eos is not None else [])
        return ids, [1] * len(ids)
    ids, mask = [], []
    for segment in target:
        piece = tokenizer(str(segment["text"]), add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [1 if segment.get("train", True) else 0] * len(piece)
    return ids, mask


def sft_batch(prompts: Batch, tokenizer: Any, target_key: str = "ground_truth") -> Batch:
    """Prompt -> target (``target_key``: the ground truth by default) as a rollout-shaped
    batch whose 'response' is the target (see :func:`_sft_target` for multi-turn ones)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    targets = [_sft_target(t, tokenizer, eos) for t in prompts[target_key]]
    width = max(len(ids) for ids, _ in targets)
    responses = torch.full((len(targets), width), pad, dtype=torch.long)
    response_mask = torch.zeros((len(targets), width), dtype=torch.long)
    real = torch.zeros((len(targets), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(targets):
        responses[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = torch.tensor(mask)
        real[i, : len(ids)] = 1
    attention = torch.cat([prompts["attention_mask"], real], dim=1)
    images = {k: prompts[k] for k in (MULTI_MODAL_KEY,) if k in prompts}
    return Batch(
        {
            "prompts": prompts["input_ids"],
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts["input_ids"], responses], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        },
        images,
    )


def token_count(batch: Batch) -> int:
    """Prompt + response tokens (the paper's throughput counts both)."""
    return int(batch["attention_mask"].sum())
