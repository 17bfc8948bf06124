"""The chunked LM-head log-prob node against plain autograd over full logits, and its memory."""

from __future__ import annotations

import pytest
import torch

from hf_core.algorithms import entropy_from_logits
from hf_core.algorithms.chunked_head import (
    TiedHeadGradient,
    chunked_head_log_probs_and_entropy,
    logits_chunk_tokens,
    tied_embedding,
)
from hf_testing.grad_checks import weighted_loss
from hf_testing.memory import policy_loss_peak_bytes


def reference(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hidden @ weight.t()
    if temperature > 0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    return log_probs, entropy_from_logits(logits)


@pytest.mark.parametrize("use", ["log_probs", "entropy", "both"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("chunk", [1, 4, 7, 100])
def test_values_and_gradients_match_full_logits(use: str, temperature: float, chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    base_hidden = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
    base_weight = torch.randn(23, 8, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 23, (3, 5), generator=gen)
    weights = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)

    def ours(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, temp: float) -> tuple:
        return chunked_head_log_probs_and_entropy(h, w, t, temperature=temp, chunk=chunk)

    results = []
    for fn in (reference, ours):
        hidden = base_hidden.clone().requires_grad_()
        weight = base_weight.clone().requires_grad_()
        log_probs, entropy = fn(hidden, weight, tokens, temperature)
        weighted_loss(log_probs, entropy, weights, use).backward()
        results.append((log_probs.detach().double(), entropy.detach().double()))
        results[-1] += (hidden.grad, weight.grad)
    for theirs, mine in zip(results[0], results[1], strict=True):
        # the node computes in float32 (as the engines do), the reference in float64
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-5, atol=1e-5)


def test_without_entropy_returns_none() -> None:
    hidden = torch.randn(6, 4)
    weight = torch.randn(9, 4)
    tokens = torch.randint(0, 9, (6,))
    log_probs, entropy = chunked_head_log_probs_and_entropy(
        hidden, weight, tokens, with_entropy=False, chunk=4
    )
    assert entropy is None
    expected = torch.log_softmax(hidden @ weight.t(), -1)[torch.arange(6), tokens]
    torch.testing.assert_close(log_probs, expected)


def test_an_engine_linear_computes_every_chunk_forward_and_recompute() -> None:
    """The engine's kernel (``kernel``, here :func:`linear_kernel` over a counting linear)
    makes each chunk's logits, in the forward and in the backward's recompute, except the
    last full chunk's, which the backward reuses; values and gradients are the default
    kernel's."""
    import torch.nn.functional as F

    from hf_core.algorithms.chunked_head import linear_kernel

    calls: list[int] = []

    def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 11, (7,), generator=gen)
    base = torch.randn(7, 6, generator=gen), torch.randn(11, 6, generator=gen)
    results = []
    for kernel in (F.linear, counting):
        hidden, weight = (t.clone().requires_grad_() for t in base)
        log_probs, entropy = chunked_head_log_probs_and_entropy(
            hidden, weight, tokens, chunk=4, kernel=linear_kernel(kernel)
        )
        assert entropy is not None
        (log_probs.sum() + entropy.sum()).backward()
        results.append((log_probs.detach(), entropy.detach(), hidden.grad, weight.grad))
    assert calls == [3, 4, 3]  # forward: remainder then full chunk; backward: remainder only
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b)


def test_a_second_backward_recomputes_what_the_first_consumed() -> None:
    """The reused logits are turned into the gradient in place; a retained graph's second
    backward must recompute them and add the same gradients again."""
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(7, 6, generator=gen, requires_grad=True)
    weight = torch.randn(11, 6, generator=gen, requires_grad=True)
    tokens = torch.randint(0, 11, (7,), generator=gen)
    log_probs, entropy = chunked_head_log_probs_and_entropy(hidden, weight, tokens, chunk=4)
    assert entropy is not None
    loss = log_probs.sum() + entropy.sum()
    loss.backward(retain_graph=True)
    assert hidden.grad is not None and weight.grad is not None
    first = hidden.grad.clone(), weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(hidden.grad, 2 * first[0])
    torch.testing.assert_close(weight.grad, 2 * first[1])


def test_bfloat16_inputs_get_gradients_in_their_dtype() -> None:
    hidden = torch.randn(10, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(32, 16, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 32, (10,))
    log_probs, _ = chunked_head_log_probs_and_entropy(hidden, weight, tokens, chunk=3)
    assert log_probs.dtype == torch.float32
    log_probs.sum().backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16
    full = torch.log_softmax((hidden.detach() @ weight.detach().t()).float(), -1)
    torch.testing.assert_close(log_probs.detach(), full[torch.arange(10), tokens])


def test_chunk_size_follows_the_budget() -> None:
    assert logits_chunk_tokens(100, 1000, budget_bytes=100 * 1000 * 4) is None
    assert logits_chunk_tokens(101, 1000, budget_bytes=100 * 1000 * 4) == 100
    assert logits_chunk_tokens(16384, 151_936, budget_bytes=256 * 2**20) == 441
    assert logits_chunk_tokens(5, 10**9, budget_bytes=1) == 1
    with pytest.raises(ValueError, match="chunk"):
        chunked_head_log_probs_and_entropy(
            torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long), chunk=0
        )


def test_memory_does_not_grow_with_tokens_at_a_real_vocabulary() -> None:
    """At Qwen2.5's vocabulary the chunked node's extra memory is the head's gradient plus a
    couple of chunks, the same for 4x the tokens; full logits grow with the tokens."""
    vocab, width, chunk = 151_936, 64, 256
    weight_bytes = vocab * width * 4
    chunk_bytes = chunk * vocab * 4
    small = policy_loss_peak_bytes(512, vocab, width, chunk)
    large = policy_loss_peak_bytes(2048, vocab, width, chunk)
    full = policy_loss_peak_bytes(2048, vocab, width, None)
    budget = weight_bytes + 3 * chunk_bytes + 64 * 2**20
    assert small <= budget and large <= budget, (small, large, budget)
    assert large < small * 1.25 + 16 * 2**20
    # full logits hold tokens x vocab floats, and their gradient as much again
    assert full >= 2 * 2048 * vocab * 4


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("head_runs", [True, False])
def test_a_tied_embedding_adds_its_gradient_into_the_heads(
    padding_idx: int | None, head_runs: bool
) -> None:
    """A tiny tied LM (embedding -> tanh -> chunked head): the shared weight's gradient,
    accumulated over two backward passes, is plain autograd's, whether the head's backward
    hands its gradient over (in place) or does not run (the embedding's own dense one)."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(11, 6, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 2, 5), generator=gen)
    ids[:, :, 0] = 2  # a padding token in every row
    tokens = torch.randint(0, 11, (2, 2, 5), generator=gen)

    def grad_of(tied: bool) -> torch.Tensor:
        weight = base.clone().requires_grad_()
        for step in range(2):  # .grad accumulates as over micro-batches
            share = TiedHeadGradient()
            embed = (
                tied_embedding(ids[step], weight, padding_idx, share)
                if tied
                else torch.nn.functional.embedding(ids[step], weight, padding_idx)
            )
            hidden = torch.tanh(embed)
            if head_runs:
                log_probs, _ = chunked_head_log_probs_and_entropy(
                    hidden, weight, tokens[step], chunk=3, share=share if tied else None
                )
                log_probs.sum().backward()
            else:
                hidden.pow(2).sum().backward()
        assert weight.grad is not None
        return weight.grad

    torch.testing.assert_close(grad_of(tied=True), grad_of(tied=False), rtol=1e-6, atol=1e-6)


def test_the_tied_embedding_writes_into_the_tensor_the_head_handed_over() -> None:
    """The saving itself: the head's gradient tensor ends up holding the whole gradient."""
    handed: list[torch.Tensor] = []

    class Recording(TiedHeadGradient):
        def __setattr__(self, name: str, value: object) -> None:
            if isinstance(value, torch.Tensor):
                handed.append(value)
            super().__setattr__(name, value)

    weight = torch.randn(11, 6, requires_grad=True)
    share = Recording()
    ids = torch.randint(0, 11, (2, 5))
    hidden = torch.tanh(tied_embedding(ids, weight, None, share))
    log_probs, _ = chunked_head_log_probs_and_entropy(hidden, weight, ids, chunk=4, share=share)
    log_probs.sum().backward()
    assert len(handed) == 1 and share.head_grad is None
    assert weight.grad is not None
    torch.testing.assert_close(handed[0], weight.grad)
