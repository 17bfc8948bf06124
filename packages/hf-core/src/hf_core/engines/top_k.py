"""Batch keys and helpers of top-k distillation that every training engine shares.

The teacher's forward (``compute_log_probs(batch, top_k=k)``) returns, per response
position, its ``k`` likeliest ids (:data:`TOP_K_IDS`) and their log-probs
(:data:`TOP_K_LOG_PROBS`); the trainer stores them in the batch as :data:`TEACHER_TOP_K_IDS`
and :data:`TEACHER_TOP_K_LOG_PROBS`.  A training forward of a micro-batch that carries
:data:`TEACHER_TOP_K_IDS` also returns the student's log-probs at those ids
(:data:`LOG_PROBS_AT_TEACHER_TOP_K`, with autograd), computed in the same head pass as the
sampled tokens' (:func:`scored_ids`, :func:`split_scored`).
"""

from __future__ import annotations

import torch

from hf_core.batch import Batch

TOP_K_IDS = "top_k_ids"
TOP_K_LOG_PROBS = "top_k_log_probs"
"""``compute_log_probs(..., top_k=k)``: the model's own ``[B, R, k]`` likeliest ids per
response position and their log-probs, likeliest first."""
TEACHER_TOP_K_IDS = "teacher_top_k_ids"
TEACHER_TOP_K_LOG_PROBS = "teacher_top_k_log_probs"
"""The teacher's top-k ids and log-probs in the trainer's batch."""
LOG_PROBS_AT_TEACHER_TOP_K = "log_probs_at_teacher_top_k"
"""A training forward's ``[B, R, k]`` log-probs at the batch's :data:`TEACHER_TOP_K_IDS`."""


def id_dtype(vocab_size: int) -> torch.dtype:
    """The smallest signed integer type holding every id of a ``vocab_size`` vocabulary
    (signed: torch gathers and scatters with int16/int32/int64 alike after ``.long()``)."""
    if vocab_size <= 2**7:
        return torch.int8
    if vocab_size <= 2**15:
        return torch.int16
    if vocab_size <= 2**31:
        return torch.int32
    return torch.int64


def top_k_bytes_per_token(k: int, vocab_size: int, log_prob_dtype: torch.dtype) -> int:
    """What the teacher's top-k add to the batch per response token."""
    ids = torch.empty((), dtype=id_dtype(vocab_size)).element_size()
    values = torch.empty((), dtype=log_prob_dtype).element_size()
    return k * (ids + values)


def compact_top_k(
    ids: torch.Tensor, log_probs: torch.Tensor, vocab_size: int, log_prob_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k as stored in the batch: ids in :func:`id_dtype`, log-probs in
    ``log_prob_dtype``."""
    return ids.to(id_dtype(vocab_size)), log_probs.to(log_prob_dtype)


def scored_ids(batch: Batch, responses: torch.Tensor) -> torch.Tensor:
    """The ids a forward scores per response position: ``responses`` ``[B, R]``, or with the
    batch's teacher top-k ids after each sampled token, ``[B, R, 1 + k]``."""
    if TEACHER_TOP_K_IDS not in batch:
        return responses
    extra = batch[TEACHER_TOP_K_IDS].to(responses.device, torch.long)
    if extra.shape[:2] != responses.shape:
        raise ValueError(
            f"{TEACHER_TOP_K_IDS} {tuple(extra.shape)} does not match responses "
            f"{tuple(responses.shape)} (expected [B, R, k])"
        )
    return torch.cat([responses.unsqueeze(-1), extra], dim=-1)


def split_scored(log_probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """``log_probs`` of :func:`scored_ids`' ids as output keys: the sampled tokens' and,
    for ``[B, R, 1 + k]``, :data:`LOG_PROBS_AT_TEACHER_TOP_K`."""
    if log_probs.dim() == 2:
        return {"log_probs": log_probs}
    return {"log_probs": log_probs[..., 0], LOG_PROBS_AT_TEACHER_TOP_K: log_probs[..., 1:]}
