"""Token selection shared by Python-side decoders: the draw matches its distribution."""

from __future__ import annotations

import torch

from hf_core.engines import SamplingParams, select_tokens
from hf_core.engines.sampling import draw


def test_draw_follows_the_distribution_and_never_picks_zero_probability() -> None:
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0]).expand(20_000, 5)
    tokens = draw(probs, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert counts[1] == 0 and counts[4] == 0
    # binomial standard error at n=20000 is <= 0.0036: 4 sigma
    assert torch.allclose(counts, probs[0], atol=0.015), counts


def test_draw_is_reproducible_per_generator_and_respects_top_k() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.7, top_k=3)
    a, lp_a = select_tokens(logits, params, torch.Generator().manual_seed(7))
    b, lp_b = select_tokens(logits, params, torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and torch.equal(lp_a, lp_b)
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == a[:, None]).any(-1).all()
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, a[:, None]).squeeze(-1)
    assert torch.allclose(lp_a, expected)
