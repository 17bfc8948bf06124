"""Top-k distillation: the divergences against torch.distributions on explicit categories, and
the heads that feed them (several ids per position, the model's own top-k) against plain
autograd over full logits."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from hf_core.algorithms.chunked_head import chunked_head
from hf_core.algorithms.distill_top_k import top_k_distill_loss, top_k_divergence
from hf_core.algorithms.token_log_probs import token_log_probs_and_entropy, top_k_log_probs
from hf_core.engines.top_k import compact_top_k, id_dtype, top_k_bytes_per_token
from hf_testing.memory import policy_loss_peak_bytes

VOCAB = 13


def _distributions(seed: int, rows: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student logits ``[rows, VOCAB]`` in float64; the teacher peaked, as a
    trained model is."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64) * 3
    student = torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64)
    return teacher, student


def _reference(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    k: int,
    loss: str,
    tail: str,
    beta: float,
) -> torch.Tensor:
    """The divergence per row from explicit category probabilities and torch.distributions'
    KL (independent of the module's log-space formulas)."""
    p_t = torch.softmax(teacher_logits, -1)
    p_s = torch.softmax(student_logits, -1)
    ids = p_t.topk(k, dim=-1).indices
    top_t, top_s = p_t.gather(-1, ids), p_s.gather(-1, ids)
    if tail == "bucket":
        cats_t = torch.cat([top_t, (1 - top_t.sum(-1, keepdim=True)).clamp(min=0)], -1)
        cats_s = torch.cat([top_s, (1 - top_s.sum(-1, keepdim=True)).clamp(min=1e-12)], -1)
    else:
        cats_t = top_t / top_t.sum(-1, keepdim=True)
        cats_s = top_s / top_s.sum(-1, keepdim=True)
    teacher, student = Categorical(probs=cats_t), Categorical(probs=cats_s)
    if loss == "forward_kl_topk":
        return kl_divergence(teacher, student)
    mixture = Categorical(probs=beta * cats_t + (1 - beta) * cats_s)
    return beta * kl_divergence(teacher, mixture) + (1 - beta) * kl_divergence(student, mixture)


def _ours(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, k: int, **kwargs: object
) -> torch.Tensor:
    teacher_lp, ids = top_k_log_probs(teacher_logits, k)
    student_lp = torch.log_softmax(student_logits, -1).gather(-1, ids)
    return top_k_divergence(student_lp, teacher_lp.double(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("loss", ["forward_kl_topk", "jsd"])
@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
@pytest.mark.parametrize("k", [1, 2, 5, VOCAB])
def test_each_loss_equals_categorical_kl_in_value_and_gradient(
    loss: str, tail: str, k: int
) -> None:
    teacher, base = _distributions(seed=k)
    beta = 0.3
    grads = []
    values = []
    for fn in (_reference, _ours):
        student = base.clone().requires_grad_()
        if fn is _reference:
            value = _reference(teacher, student, k, loss, tail, beta)
        else:
            value = _ours(teacher, student, k, loss=loss, tail=tail, beta=beta)
        weights = torch.linspace(0.5, 1.5, value.shape[0], dtype=torch.float64)
        (value * weights).sum().backward()
        values.append(value.detach())
        grads.append(student.grad)
    # the teacher's log-probs pass through float32 (how the batch stores them)
    torch.testing.assert_close(values[1], values[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_k_equal_to_the_vocabulary_is_the_exact_divergence(tail: str) -> None:
    teacher, student = _distributions(seed=3)
    p_t, log_s = torch.softmax(teacher, -1), torch.log_softmax(student, -1)
    forward = (p_t * (torch.log_softmax(teacher, -1) - log_s)).sum(-1)
    got = _ours(teacher, student, VOCAB, loss="forward_kl_topk", tail=tail)
    torch.testing.assert_close(got, forward, rtol=1e-5, atol=1e-6)
    m = 0.5 * p_t + 0.5 * log_s.exp()
    jsd = 0.5 * (p_t * (p_t / m).log()).sum(-1) + 0.5 * (log_s.exp() * (log_s.exp() / m).log()).sum(
        -1
    )
    got = _ours(teacher, student, VOCAB, loss="jsd", tail=tail, beta=0.5)
    torch.testing.assert_close(got, jsd, rtol=1e-5, atol=1e-6)


def test_identical_distributions_have_zero_divergence_and_gradient() -> None:
    teacher, _ = _distributions(seed=4)
    student = teacher.clone().requires_grad_()
    for loss in ("forward_kl_topk", "jsd"):
        value = _ours(teacher, student, 4, loss=loss)
        assert float(value.detach().abs().max()) < 1e-6
        value.sum().backward()
        assert student.grad is not None and float(student.grad.abs().max()) < 1e-6
        student.grad = None


def test_the_aggregated_loss_is_the_mean_over_unmasked_tokens_only() -> None:
    teacher, student = _distributions(seed=5, rows=12)
    teacher_lp, ids = top_k_log_probs(teacher, 3)
    student_lp = torch.log_softmax(student, -1).gather(-1, ids)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    shape = (2, 6, 3)
    loss, metrics = top_k_distill_loss(
        student_lp.reshape(shape), teacher_lp.reshape(shape), mask, loss="forward_kl_topk"
    )
    per_token = _reference(teacher, student, 3, "forward_kl_topk", "bucket", 0.5).reshape(2, 6)
    expected = per_token[mask.bool()].mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert abs(metrics["distill/forward_kl_topk"] - float(expected)) < 1e-5
    # garbage under the mask (a padded position's ids, NaN log-probs) changes nothing
    poisoned = student_lp.reshape(shape).clone()
    poisoned[~mask.bool()] = float("nan")
    again, _ = top_k_distill_loss(poisoned, teacher_lp.reshape(shape), mask, loss="forward_kl_topk")
    torch.testing.assert_close(again, loss)
    mass = torch.softmax(teacher, -1).topk(3, -1).values.sum(-1).reshape(2, 6)
    assert abs(metrics["distill/teacher_top_k_mass"] - float(mass[mask.bool()].mean())) < 1e-5


def test_bad_arguments_are_named() -> None:
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same"):
        top_k_divergence(a, torch.zeros(2, 4), loss="forward_kl_topk")
    with pytest.raises(ValueError, match="beta"):
        top_k_divergence(a, a, loss="jsd", beta=1.0)
    with pytest.raises(ValueError, match="top-k loss"):
        top_k_divergence(a, a, loss="reverse")  # type: ignore[arg-type]


# ----------------------------------------------------------------- the heads feeding it
def _head_reference(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hidden @ weight.t()
    if temperature > 0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, -1)
    return log_probs.gather(-1, ids), torch.softmax(logits, -1).mul(log_probs).sum(-1).neg()


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_chunked_head_scores_several_ids_per_position(chunk: int, temperature: float) -> None:
    """The sampled token plus k teacher ids (one of them often the same id): values and
    gradients of the log-probs and entropy equal autograd over full logits."""
    gen = torch.Generator().manual_seed(chunk)
    base_hidden = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    base_weight = torch.randn(17, 8, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 17, (2, 5, 4), generator=gen)
    ids[..., 1] = ids[..., 0]  # a repeated id: both gradients land on one logit
    weights = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    entropy_weights = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    results = []
    for use_chunked in (False, True):
        hidden = base_hidden.clone().requires_grad_()
        weight = base_weight.clone().requires_grad_()
        if use_chunked:
            out = chunked_head(hidden, weight, ids, temperature=temperature, chunk=chunk)
            log_probs, entropy = out.log_probs, out.entropy
        else:
            log_probs, entropy = _head_reference(hidden, weight, ids, temperature)
        assert entropy is not None
        ((log_probs * weights).sum() + (entropy * entropy_weights).sum()).backward()
        results.append((log_probs.detach().double(), entropy.detach().double()))
        results[-1] += (hidden.grad, weight.grad)
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [2, 100])
def test_the_chunked_head_returns_each_positions_own_top_k(chunk: int) -> None:
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 4, 6, generator=gen)
    weight = torch.randn(19, 6, generator=gen)
    tokens = torch.randint(0, 19, (3, 4), generator=gen)
    out = chunked_head(hidden, weight, tokens, temperature=0.8, chunk=chunk, top_k=5)
    expected = torch.log_softmax(hidden @ weight.t() / 0.8, -1).topk(5, dim=-1)
    assert out.top_k_ids is not None and out.top_k_log_probs is not None
    assert torch.equal(out.top_k_ids, expected.indices)
    torch.testing.assert_close(out.top_k_log_probs, expected.values)
    assert out.log_probs.shape == (3, 4)  # one id per position: the plain shape
    with pytest.raises(ValueError, match="top_k"):
        chunked_head(hidden, weight, tokens, chunk=chunk, top_k=20)


def test_full_logits_score_several_ids_and_the_top_k() -> None:
    gen = torch.Generator().manual_seed(8)
    base = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3, 4), generator=gen)
    weights = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    grads = []
    for ours in (False, True):
        logits = base.clone().requires_grad_()
        if ours:
            log_probs, _ = token_log_probs_and_entropy(logits, ids, with_entropy=False)
        else:
            log_probs = torch.log_softmax(logits, -1).gather(-1, ids)
        (log_probs * weights).sum().backward()
        grads.append((log_probs.detach(), logits.grad))
    for expected, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected)
    values, top = top_k_log_probs(base, 3)
    assert torch.equal(top, base.topk(3, -1).indices)
    torch.testing.assert_close(values, torch.log_softmax(base, -1).topk(3, -1).values.float())


def test_top_k_storage_is_compact_and_counted() -> None:
    assert id_dtype(100) == torch.int8
    assert id_dtype(32_000) == torch.int16
    assert id_dtype(151_936) == torch.int32
    assert top_k_bytes_per_token(64, 151_936, torch.bfloat16) == 64 * (4 + 2)
    ids = torch.tensor([[151_935, 3]])
    stored, values = compact_top_k(ids, torch.zeros(1, 2), 151_936, torch.bfloat16)
    assert stored.dtype == torch.int32 and values.dtype == torch.bfloat16
    assert torch.equal(stored.long(), ids)


def test_the_top_k_loss_stays_within_the_chunked_heads_bound() -> None:
    """At a real vocabulary the top-k loss adds ``O(tokens k)`` to the chunked head's bound
    (the head's gradient and about two chunks of logits), whatever the token count:
    bench/loss_memory.py measures the 16,384-token micro-batch at k = 64."""
    vocab, width, chunk, k = 151_936, 64, 256, 64
    budget = vocab * width * 4 + 3 * chunk * vocab * 4 + 64 * 2**20
    small = policy_loss_peak_bytes(256, vocab, width, chunk, top_k=k)
    large = policy_loss_peak_bytes(1024, vocab, width, chunk, top_k=k)
    assert small <= budget and large <= budget, (small, large, budget)
    # what grows with the tokens is k floats per token a few times over, not the vocabulary
    assert large - small < (1024 - 256) * k * 4 * 16 + 4 * 2**20, (small, large)
