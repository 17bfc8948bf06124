"""Token log-probs and entropy straight from hidden states and the LM head, in token chunks.

Why: at a real vocabulary the logits dominate a micro-batch's memory.  16,384 tokens x
151,936 (Qwen2.5) is 9.96 GB of float32 logits, and the log-softmax backward wants a
second tensor that size.  Here the head's matmul runs over ``chunk`` tokens at a time: the
forward keeps only per-token scalars (log-normaliser, entropy), and the backward recomputes
each chunk's logits, turns them into the logits' gradient in place and folds it into the
hidden states' and head weight's gradients before the next chunk.  Extra memory is about two
chunks of logits plus the weight's gradient, whatever the token count (plus whatever the
engine's :data:`HeadKernel` prepares for a pass, e.g. a float32 copy of a 16-bit weight).

The price is one more head matmul per token in the backward (the recompute), which is why
:func:`logits_chunk_tokens` returns ``None`` -- use the plain full-logits path -- when the
whole micro-batch's logits fit the budget: small vocabularies keep their speed.

Several ids per position (the sampled token and a teacher's top-k, for distillation) share
the pass: their log-probs come out ``[..., m]`` and their gradients fold into the one
logits' gradient (``sum_j g_j onehot(y_j) - p sum_j g_j``).  ``top_k`` also returns each
position's own ``k`` likeliest ids and their log-probs (a frozen teacher's distribution,
without gradient), taken chunk by chunk like everything else.

Gradients, with ``z = h W^T / T``, ``p = softmax(z)``, ``H = -sum p log p``:
``d log p_y / dz = onehot(y) - p``, ``dH / dz = -p (log p + H)``, then ``dh = dz W / T`` and
``dW = dz^T h / T``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

DEFAULT_LOGITS_BUDGET_BYTES = 256 * 1024 * 1024
"""Float32 logits one chunk may hold (the recompute keeps about two such tensors)."""


def logits_chunk_tokens(tokens: int, vocab: int, budget_bytes: int) -> int | None:
    """Tokens per chunk so that a chunk's float32 logits fit ``budget_bytes``, or ``None``
    when all ``tokens`` fit at once (then full logits are cheaper: no recompute)."""
    per_token = vocab * 4
    if tokens * per_token <= budget_bytes:
        return None
    return max(1, budget_bytes // per_token)


class HeadProducts(Protocol):
    """The head's two products over the chunks of one pass (forward or backward)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A chunk's logits ``hidden @ weight.T``, ``[n, V]`` (made float32 by the caller)."""
        ...

    def input_grad(self, grad: torch.Tensor, out: torch.Tensor) -> None:
        """``grad @ weight`` (the chunk's hidden-state gradient) written into ``out``."""
        ...


HeadKernel = Callable[[torch.Tensor, torch.Tensor], HeadProducts]
"""``kernel(hidden, weight)``: the head's products for one pass over ``hidden``'s chunks,
built once a pass, so an engine may prepare the weight once (e.g. in a dtype its device
multiplies natively); :func:`linear_kernel` by default."""


HeadLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``linear(hidden, weight, bias)``: an engine's own linear kernel for the head's forward
(e.g. hf-fsdp's oneDNN linear on CPU)."""


class LinearProducts:
    """The products through a ``linear(x, weight, bias)`` kernel and ``torch.matmul``."""

    def __init__(self, weight: torch.Tensor, linear: HeadLinear = F.linear) -> None:
        self.weight, self.linear = weight, linear

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden, self.weight, None)

    def input_grad(self, grad: torch.Tensor, out: torch.Tensor) -> None:
        torch.matmul(grad, self.weight, out=out)


def linear_kernel(linear: HeadLinear = F.linear) -> HeadKernel:
    """A :data:`HeadKernel` computing the logits with ``linear`` (``F.linear`` by default)."""
    return lambda hidden, weight: LinearProducts(weight, linear)


def _chunk_logits(
    hidden: torch.Tensor, products: HeadProducts, inverse_temperature: float
) -> torch.Tensor:
    logits = products.logits(hidden).float()
    if inverse_temperature != 1.0:
        logits.mul_(inverse_temperature)
    return logits


def _spans(count: int, chunk: int) -> list[tuple[int, int]]:
    """Token ranges of at most ``chunk``, the remainder first so that the last one (whose
    logits the backward reuses) is a full chunk."""
    if count == 0:
        return []
    first = count % chunk or min(chunk, count)
    bounds = [0, *range(first, count + 1, chunk)]
    return list(itertools.pairwise(bounds))


class _ChunkedHeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        tokens: torch.Tensor,
        inverse_temperature: float,
        with_entropy: bool,
        chunk: int,
        kernel: HeadKernel,
        share: TiedHeadGradient | None,
        top_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        count, width = tokens.shape
        log_probs = hidden.new_empty(count, width, dtype=torch.float32)
        log_z = hidden.new_empty(count, dtype=torch.float32)
        entropy = hidden.new_empty(count if with_entropy else 0, dtype=torch.float32)
        top_log_probs = hidden.new_empty(count, top_k, dtype=torch.float32)
        top_ids = tokens.new_empty(count, top_k)
        products = kernel(hidden, weight)
        spans = _spans(count, chunk)
        logits = hidden.new_empty(0)
        for start, stop in spans:
            del logits
            logits = _chunk_logits(hidden[start:stop], products, inverse_temperature)
            norm = torch.logsumexp(logits, dim=-1)
            log_z[start:stop] = norm
            picked = logits.gather(-1, tokens[start:stop])
            log_probs[start:stop] = picked - norm[:, None]
            if top_k:
                values, ids = logits.topk(top_k, dim=-1)
                top_log_probs[start:stop] = values - norm[:, None]
                top_ids[start:stop] = ids
            if with_entropy:
                # H = log_z - sum p z; softmax in place over the chunk's logits
                weighted = torch.linalg.vecdot(torch.softmax(logits, dim=-1), logits)
                entropy[start:stop] = norm - weighted
        ctx.save_for_backward(hidden, weight, tokens, log_z, entropy)
        # the last (full-sized) chunk's logits stay for the backward, which starts with them:
        # one chunk's recompute saved at no extra peak (the forward ends holding them anyway)
        ctx.kept_logits = logits
        ctx.spans = spans
        ctx.inverse_temperature = inverse_temperature
        ctx.kernel = kernel
        ctx.share = share
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(tokens, top_log_probs, top_ids)
        if not with_entropy:
            entropy = log_z.new_zeros(())
        return log_probs, entropy, top_log_probs, top_ids

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any,
        grad_log_probs: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        _grad_top_log_probs: None,
        _grad_top_ids: None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None, None, None]:
        hidden, weight, tokens, log_z, entropy = ctx.saved_tensors
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None, None
        total = None if grad_log_probs is None else grad_log_probs.sum(-1)
        scale = ctx.inverse_temperature
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # the head's gradient accumulates in float32 whatever the compute dtype; the first
        # chunk writes it (zero-filling a vocabulary-sized buffer is a pass over all of it)
        grad_weight: torch.Tensor | None = None
        products = ctx.kernel(hidden, weight)
        kept, ctx.kept_logits = ctx.kept_logits, None  # a second backward recomputes
        for start, stop in reversed(ctx.spans):
            part = hidden[start:stop]
            if kept is not None:
                grad, kept = kept, None
            else:
                grad = _chunk_logits(part, products, scale)
            grad.sub_(log_z[start:stop, None])  # log p
            if grad_entropy is not None:
                # -p (log p + H) g_H  (minus p g_lp below), in place over log p
                log_p = grad
                probs = log_p.exp()
                log_p.add_(entropy[start:stop, None]).mul_(probs)
                log_p.mul_(-grad_entropy[start:stop, None])
                if total is not None:
                    log_p.sub_(probs.mul_(total[start:stop, None]))
                del probs
            else:
                assert total is not None
                grad.exp_().mul_(-total[start:stop, None])
            if grad_log_probs is not None:
                grad.scatter_add_(-1, tokens[start:stop], grad_log_probs[start:stop].float())
            if scale != 1.0:
                grad.mul_(scale)
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                products.input_grad(grad, grad_hidden[start:stop])
            if want_weight and grad_weight is None:
                grad_weight = torch.mm(grad.t().float(), part.float())
            elif grad_weight is not None:
                grad_weight.addmm_(grad.t().float(), part.float())
            del grad
        if want_weight and grad_weight is None:  # no tokens
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        if grad_weight is not None and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        if ctx.share is not None and grad_weight is not None:
            ctx.share.head_grad = grad_weight  # the tied embedding's backward adds into it
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def chunked_head_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk: int,
    kernel: HeadKernel | None = None,
    share: TiedHeadGradient | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(h W^T / T)[tokens]`` and (when ``with_entropy``) its entropy, for
    ``hidden`` ``[..., H]`` and a bias-free head ``weight`` ``[V, H]``; outputs have
    ``hidden.shape[:-1]``, float32, differentiable in ``hidden`` and ``weight``.

    ``tokens`` is ``hidden.shape[:-1]``, or has one more dimension ``m`` for several ids per
    position (log-probs ``[..., m]``).  ``temperature`` 0 (greedy) or 1 uses the raw
    logits.  Logits never exist for more than ``chunk`` tokens at a time (see the module
    docstring).  ``kernel`` supplies the logits and the hidden states' gradient (the
    engine's own products; :func:`linear_kernel` by default); the weight's gradient
    accumulates in float32 here.  ``share`` hands the head weight's gradient to a tied input
    embedding (:func:`tied_embedding`).
    """
    head = chunked_head(
        hidden,
        weight,
        tokens,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk=chunk,
        kernel=kernel,
        share=share,
    )
    return head.log_probs, head.entropy


class ChunkedHeadOutputs(NamedTuple):
    """What one pass of :func:`chunked_head` returns (shapes in its docstring)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    top_k_log_probs: torch.Tensor | None
    top_k_ids: torch.Tensor | None


def chunked_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk: int,
    kernel: HeadKernel | None = None,
    share: TiedHeadGradient | None = None,
    top_k: int = 0,
) -> ChunkedHeadOutputs:
    """:func:`chunked_head_log_probs_and_entropy`, plus (``top_k > 0``) each position's
    ``top_k`` likeliest ids and their log-probs, ``[..., top_k]``, likeliest first, without
    gradient."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    if not 0 <= top_k <= weight.shape[0]:
        raise ValueError(f"top_k must be in [0, vocabulary {weight.shape[0]}], got {top_k}")
    lead = hidden.shape[:-1]
    several = tokens.dim() == hidden.dim()
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_tokens = tokens.reshape(flat_hidden.shape[0], -1)
    inverse = 1.0 / temperature if temperature > 0 else 1.0
    products = kernel if kernel is not None else linear_kernel()
    log_probs, entropy, top_log_probs, top_ids = _ChunkedHeadLogProbs.apply(
        flat_hidden, weight, flat_tokens, inverse, with_entropy, chunk, products, share, top_k
    )
    return ChunkedHeadOutputs(
        log_probs=log_probs.reshape(*lead, -1) if several else log_probs.reshape(lead),
        entropy=entropy.reshape(lead) if with_entropy else None,
        top_k_log_probs=top_log_probs.reshape(*lead, top_k) if top_k else None,
        top_k_ids=top_ids.reshape(*lead, top_k) if top_k else None,
    )


class TiedHeadGradient:
    """Where the chunked head leaves its weight gradient for a tied input embedding.

    Why: with tied embeddings autograd would give the embedding lookup its own dense
    vocabulary-sized gradient (zero-filled, rows added) and then sum it with the head's out
    of place: three passes over the vocabulary-sized gradient, a visible share of a CPU
    update (docs/performance.md, "Measured choices").  The head's backward runs first (it is
    the end of the graph), so the embedding's backward can add its few rows into the head's
    gradient in place and report none of its own; autograd then accumulates the one tensor.
    Used for one forward and backward, then dropped.
    """

    def __init__(self) -> None:
        self.head_grad: torch.Tensor | None = None


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        ids: torch.Tensor,
        weight: torch.Tensor,
        padding_idx: int | None,
        share: TiedHeadGradient,
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx = padding_idx
        ctx.share = share
        ctx.weight_shape = weight.shape
        ctx.mark_non_differentiable(ids)
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[None, torch.Tensor | None, None, None]:
        (ids,) = ctx.saved_tensors
        flat_ids = ids.reshape(-1)
        rows = grad_out.reshape(flat_ids.shape[0], -1)
        if ctx.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            rows = rows.masked_fill((flat_ids == ctx.padding_idx)[:, None], 0.0)
        target, ctx.share.head_grad = ctx.share.head_grad, None
        if target is None:  # the head's backward did not run through the share: own gradient
            dense = rows.new_zeros(ctx.weight_shape)
            return None, dense.index_add_(0, flat_ids, rows), None, None
        target.index_add_(0, flat_ids, rows.to(target.dtype))
        return None, None, None, None


def tied_embedding(
    ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, share: TiedHeadGradient
) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient goes into the chunked
    head's (same ``share``) when the head's backward left one there."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(ids, weight, padding_idx)
    return _TiedEmbedding.apply(ids, weight, padding_idx, share)
