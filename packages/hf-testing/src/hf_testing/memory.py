"""Peak resident memory of a block of code, for memory tests and benches on CPU.

CPU tensors have no allocator statistics, so the process's high-water mark is the measure:
``VmHWM`` is reset to the current RSS (``/proc/self/clear_refs``) before the block and read
after it.  Large tensors are ``mmap``-ed by glibc and leave RSS when freed, so a block's peak
is its own; run ``gc.collect()`` first so earlier garbage does not count.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    text = Path("/proc/self/status").read_text()
    found = re.search(rf"{key}:\s+(\d+)", text)
    if found is None:
        raise KeyError(f"/proc/self/status has no {key} field")
    return int(found.group(1))


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


@contextmanager
def peak_rss_extra() -> Iterator[dict[str, int]]:
    """Peak RSS during the block minus RSS before it, in bytes (``["bytes"]`` after it)."""
    before = status_kib("VmRSS")
    reset_peak()
    out = {"bytes": 0}
    yield out
    out["bytes"] = (status_kib("VmHWM") - before) * 1024


def policy_loss_peak_bytes(
    tokens: int, vocab: int, hidden_size: int, chunk: int | None, top_k: int = 0
) -> int:
    """Peak extra RSS of a PPO-clip loss forward + backward over ``tokens`` tokens through an
    LM head of ``vocab`` x ``hidden_size``: full logits (``chunk=None``, the fused log-prob
    node over them) or the chunked head (:mod:`hf_core.algorithms.chunked_head`).  With
    ``top_k``, the loss adds top-k distillation's JSD to a teacher's ``top_k`` ids and
    log-probs per token (:mod:`hf_core.algorithms.distill_top_k`), the head scoring those
    ids beside the sampled token.  Inputs (the teacher's top-k included) are allocated
    before the measurement starts."""
    import gc

    import torch

    from hf_core.algorithms import token_log_probs_and_entropy
    from hf_core.algorithms.chunked_head import chunked_head_log_probs_and_entropy
    from hf_core.algorithms.distill_top_k import top_k_divergence

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.02).requires_grad_()
    ids = torch.randint(0, vocab, (tokens, 1 + top_k), generator=gen)
    teacher = torch.log_softmax(torch.randn(tokens, top_k + 1, generator=gen), -1)[:, :top_k]
    advantages = torch.randn(tokens, generator=gen)
    gc.collect()
    with peak_rss_extra() as peak:
        if chunk is None:  # the engines' full-logits node (what they used before chunking)
            logits = hidden @ weight.t()
            scored, _ = token_log_probs_and_entropy(logits, ids, with_entropy=True)
            del logits
        else:
            scored, _ = chunked_head_log_probs_and_entropy(
                hidden, weight, ids, chunk=chunk, with_entropy=True
            )
        log_probs = scored[:, 0]
        ratio = torch.exp(log_probs - log_probs.detach())
        loss = -(torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)).mean()
        if top_k:
            loss = loss + top_k_divergence(scored[:, 1:], teacher, loss="jsd").mean()
        loss.backward()
    return peak["bytes"]
