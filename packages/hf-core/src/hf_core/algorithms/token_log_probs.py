"""Log-probs of chosen tokens and the entropy, from full-vocabulary logits, in one autograd node.

Why not plain autograd: over ``[B, T, V]`` logits, ``logsumexp`` + ``gather`` + ``softmax``
each save or rebuild vocabulary-sized tensors, and their backward adds a zero-filled
scatter, a subtract, an exp and a sum of two gradients, each a pass over ``B*T*V`` floats.
Those passes were a tenth of a small model's update on CPU.  Here the forward saves only
the logits (and per-token scalars); the backward rebuilds ``softmax`` once and writes the
gradient into it in place.  The entropy's gradient is only computed when a loss uses it
(an entropy bonus); as a metric it costs its forward alone.

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
        log_probs = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_z
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
        if grad_entropy is None:
            assert grad_log_probs is not None
            grad = probs.mul_(-grad_log_probs.unsqueeze(-1))
        else:
            # -p (log p + H) = -p (z - log_z + H), times the incoming gradient
            shift = (entropy - log_z).unsqueeze(-1)
            grad = probs * (logits + shift) * (-grad_entropy).unsqueeze(-1)
            if grad_log_probs is not None:
                grad.sub_(probs * grad_log_probs.unsqueeze(-1))
        if grad_log_probs is not None:
            grad.scatter_add_(-1, tokens.unsqueeze(-1), grad_log_probs.unsqueeze(-1))
        return grad, None, None


def token_log_probs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits)[tokens]`` and (when ``with_entropy``) the entropy of
    ``softmax(logits)``, both ``logits.shape[:-1]``; differentiable in ``logits``.

    ``logits`` are used as given (divide by a temperature first); float32 or wider.
    """
    log_probs, entropy = _TokenLogProbs.apply(logits, tokens, with_entropy)
    return log_probs, (entropy if with_entropy else None)
