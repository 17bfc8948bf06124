"""Distillation against the teacher's next-token distribution, truncated to its top-k tokens.

On-policy distillation with one log-prob per sampled token (:mod:`hf_core.algorithms.distill`)
sees the teacher through the student's samples only.  Here the teacher returns, per response
position, its ``k`` likeliest ids and their log-probs; the student's log-probs at those same
ids come from its own forward (the chunked head gathers them without full logits), and a
divergence between the two distributions is the loss:

* ``forward_kl_topk``: KL(teacher ‖ student) = Σ_c p_t(c) (log p_t(c) − log p_s(c))
  (supervised KD, Hinton et al. 2015; GKD's β = 0 end).
* ``jsd``: GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024, arXiv
  2306.13649, eq. 3), with ``m = β p_t + (1 − β) p_s``:
  JSD_β = β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m); β → 0 behaves like forward KL, β → 1 like
  reverse KL (both scaled by β or 1 − β).

The categories ``c`` are the top-k ids plus, for the mass the top-k leave out, one of:

* ``bucket`` (the default): one more category holding ``1 − Σ_topk p`` for each model, so the
  student is also told how much mass belongs outside the teacher's top-k.  Exact at
  ``k = vocabulary`` (both tails are 0).
* ``renormalize``: both distributions renormalised over the top-k ids (the tail ignored), as
  top-k logit distillation commonly does.  Also exact at ``k = vocabulary``.

Both are computed from ``[N, k]`` log-prob tensors in float32 (or wider): the memory is
``O(N k)``, never ``O(N V)``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from hf_core.algorithms.aggregation import aggregate_loss
from hf_core.algorithms.groups import GroupIndex
from hf_core.algorithms.masked import check_token_shapes, masked_mean

TopKLoss = Literal["forward_kl_topk", "jsd"]
TailMode = Literal["bucket", "renormalize"]
TOP_K_LOSSES: tuple[str, ...] = ("forward_kl_topk", "jsd")

_TAIL_FLOOR = 1e-12
"""Smallest tail mass the student is given credit for: a student tail of 0 under a teacher
tail of 0 (``k`` = vocabulary) contributes 0, not ``0 · log 0``."""


def _with_tail(log_probs: torch.Tensor) -> torch.Tensor:
    """``[..., k + 1]``: the ``k`` log-probs and the log of the mass they leave out."""
    covered = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=0.0)
    tail = torch.log((-torch.expm1(covered)).clamp(min=_TAIL_FLOOR))
    return torch.cat([log_probs, tail], dim=-1)


def categories(log_probs: torch.Tensor, tail: TailMode) -> torch.Tensor:
    """The log-probs over the categories the divergence compares (``tail`` as documented
    in the module docstring)."""
    if tail == "renormalize":
        return log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True)
    if tail == "bucket":
        return _with_tail(log_probs)
    raise ValueError(f"unknown tail mode {tail!r}; expected 'bucket' or 'renormalize'")


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Σ_c p (log p − log q), with 0 where p is 0."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def top_k_divergence(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    *,
    loss: TopKLoss,
    beta: float = 0.5,
    tail: TailMode = "bucket",
) -> torch.Tensor:
    """Per-position divergence ``[...]`` between the teacher's top-k distribution and the
    student's at the same ids (``[..., k]`` log-probs each; the teacher's carry no gradient).
    """
    if student_log_probs.shape != teacher_log_probs.shape:
        raise ValueError(
            f"student log-probs {tuple(student_log_probs.shape)} and teacher log-probs "
            f"{tuple(teacher_log_probs.shape)} must have the same [..., k] shape"
        )
    dtype = torch.promote_types(student_log_probs.dtype, torch.float32)
    student = categories(student_log_probs.to(dtype), tail)
    teacher = categories(teacher_log_probs.detach().to(dtype), tail)
    if loss == "forward_kl_topk":
        return _kl(teacher, student)
    if loss == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
        mixture = torch.logsumexp(
            torch.stack([teacher + math.log(beta), student + math.log1p(-beta)]), dim=0
        )
        return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)
    raise ValueError(f"unknown top-k loss {loss!r}; expected one of {', '.join(TOP_K_LOSSES)}")


def top_k_distill_loss(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss: TopKLoss,
    beta: float = 0.5,
    tail: TailMode = "bucket",
    loss_agg_mode: str = "token-mean",
    index: GroupIndex | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The divergence aggregated over response tokens like the policy loss
    (``loss_agg_mode``, ``index`` and ``norm_length`` as in
    :func:`~hf_core.algorithms.aggregation.aggregate_loss`), unscaled: add
    ``coef * loss``.  ``[B, R, k]`` log-probs, ``[B, R]`` mask.

    Metrics: ``distill/<loss>`` (the token mean of the divergence) and
    ``distill/teacher_top_k_mass`` (how much of the teacher's mass its top-k hold)."""
    check_token_shapes(
        response_mask,
        student_log_probs=student_log_probs[..., 0],
        teacher_log_probs=teacher_log_probs[..., 0],
    )
    per_token = top_k_divergence(
        student_log_probs, teacher_log_probs, loss=loss, beta=beta, tail=tail
    )
    valid = response_mask != 0
    per_token = torch.where(valid, per_token, 0.0)
    total = aggregate_loss(
        per_token, response_mask, loss_agg_mode, index=index, norm_length=norm_length
    )
    mass = torch.logsumexp(teacher_log_probs.detach().float(), dim=-1).exp()
    return total, {
        f"distill/{loss}": float(masked_mean(per_token.detach(), response_mask)),
        "distill/teacher_top_k_mass": float(masked_mean(mass, response_mask)),
    }
