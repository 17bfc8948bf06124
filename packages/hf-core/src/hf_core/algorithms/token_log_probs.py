"""Log-probs of chosen tokens and the entropy, from full-vocabulary logits, in one autograd node.

Why not plain autograd: over ``[B, T, V]`` logits, ``logsumexp`` + ``gather`` + ``softmax``
each save or rebuild vocabulary-sized tensors, and their backward adds a zero-filled
scatter, a subtract, an exp and a sum of two gradients, each a pass over ``B*T*V`` floats.
Those passes were a tenth of a small model's update on CPU.  Here the forward saves only
the logits (and per-token scalars); the backward rebuilds ``softmax`` once and writes the
gradient into it in place.  The entropy's gradient is only computed when a loss uses it
(an entropy bonus); as a metric it costs its forward alone.

Several tokens per position (``tokens`` with one more dimension than the positions: the
sampled token and a teacher's top-k ids, for distillation) share the one node: with
incoming gradients ``g_j`` of ``log p_{y_j}`` the logits' gradient is
``sum_j g_j onehot(y_j) - p sum_j g_j``, one scatter and one scaled softmax whatever ``k``.

Gradients, with ``p = softmax(z)`` and ``H = -sum p log p``:
``d log p_y / dz = onehot(y) - p`` and ``dH / dz = -p (log p + H)``.
"""

from __future__ import annotations

from typing import Any

import torch


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        log_z = torch.logsumexp(logits, dim=-1)
        log_probs = logits.gather(-1, tokens) - log_z[..., None]
        if with_entropy:
            entropy = log_z - torch.linalg.vecdot(torch.softmax(logits, dim=-1), logits)
        else:
            entropy = log_z.new_zeros(())
        ctx.save_for_backward(logits, tokens, log_z, entropy)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(tokens)
        return log_probs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None]:
        logits, tokens, log_z, entropy = ctx.saved_tensors
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None
        probs = torch.softmax(logits, dim=-1)
        total = None if grad_log_probs is None else grad_log_probs.sum(-1, keepdim=True)
        if grad_entropy is None:
            assert total is not None
            grad = probs.mul_(-total)
        else:
            # -p (log p + H) = -p (z - log_z + H), times the incoming gradient
            shift = (entropy - log_z).unsqueeze(-1)
            grad = probs * (logits + shift) * (-grad_entropy).unsqueeze(-1)
            if total is not None:
                grad.sub_(probs * total)
        if grad_log_probs is not None:
            grad.scatter_add_(-1, tokens, grad_log_probs.to(grad.dtype))
        return grad, None, None


def token_log_probs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits)[tokens]`` and (when ``with_entropy``) the entropy of
    ``softmax(logits)`` (``logits.shape[:-1]``); differentiable in ``logits``.

    ``tokens`` is ``logits.shape[:-1]`` (one token per position: log-probs of that shape) or
    has one more dimension ``m`` (several ids per position: log-probs ``[..., m]``).
    ``logits`` are used as given (divide by a temperature first); float32 or wider.
    """
    several = tokens.dim() == logits.dim()
    ids = tokens if several else tokens.unsqueeze(-1)
    log_probs, entropy = _TokenLogProbs.apply(logits, ids, with_entropy)
    return (log_probs if several else log_probs.squeeze(-1)), (entropy if with_entropy else None)


@torch.no_grad()
def top_k_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` likeliest ids per position and their log-probs under ``softmax(logits)``
    (``[..., k]`` each, likeliest first); no gradient (a frozen teacher's distribution)."""
    logits = logits.float()
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return values - torch.logsumexp(logits, dim=-1, keepdim=True), ids
