"""On-policy distillation: the student samples, a teacher scores each sampled token.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD, arXiv 2306.13649) and Gu et al. 2024, "MiniLLM" (arXiv 2306.08543) minimise
the reverse KL, KL(π_s ‖ π_t) = E_{y~π_s}[Σ_t log π_s(y_t) − log π_t(y_t)], on the student's
own samples.  Taking each token's log-ratio as its own (undiscounted, per-token) reward, the
gradient is E[Σ_t (log π_s − log π_t)·∇ log π_s(y_t)], so the distillation enters the RL
update as a dense per-token advantage

    A_t += coef · (log π_t(y_t) − log π_s(y_t)),

next to (or instead of) the task reward's advantage: tokens the teacher finds likelier than
the student are reinforced, the others pushed down.  The alternative, the KL as a loss term,
is ``hf_core.algorithms.kl_loss`` with the teacher's log-probs as the reference.
"""

from __future__ import annotations

import torch

from hf_core.algorithms.masked import check_token_shapes, masked_mean


def reverse_kl_advantage(
    advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``advantages + coef·(log π_t − log π_s)`` on response tokens (0 on padding).

    Metrics: ``distill/reverse_kl`` (per-token mean of log π_s − log π_t, the k1 estimate of
    KL(π_s ‖ π_t) on the student's samples) and ``distill/teacher_log_prob``.
    """
    check_token_shapes(
        response_mask,
        advantages=advantages,
        student_log_probs=student_log_probs,
        teacher_log_probs=teacher_log_probs,
    )
    valid = response_mask != 0
    gap = torch.where(valid, teacher_log_probs - student_log_probs, 0.0).detach()
    out = torch.where(valid, advantages + coef * gap, 0.0)
    metrics = {
        "distill/reverse_kl": float(masked_mean(-gap, response_mask)),
        "distill/teacher_log_prob": float(masked_mean(teacher_log_probs, response_mask)),
    }
    return out, metrics
