"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476 §3.4, eq. 13), checked
against the piecewise formula written out per length."""

from __future__ import annotations

import pytest
import torch
from float64 import D

from hf_core.algorithms import overlong_penalty


def reference(length: int, max_new_tokens: int, buffer: int) -> float:
    """R_length of eq. 13, with L_max = max_new_tokens and L_cache = buffer."""
    free = max_new_tokens - buffer
    if length <= free:
        return 0.0
    if length <= max_new_tokens:
        return (free - length) / buffer
    return -1.0


@pytest.mark.parametrize(("max_new_tokens", "buffer"), [(20, 4), (20, 19), (16, 1), (512, 128)])
def test_every_length_matches_the_piecewise_formula(max_new_tokens: int, buffer: int) -> None:
    lengths = torch.arange(0, max_new_tokens + 4)  # beyond the limit too (eq. 13's third case)
    penalty = overlong_penalty(lengths, max_new_tokens, buffer, dtype=D)
    expected = [reference(int(n), max_new_tokens, buffer) for n in lengths]
    torch.testing.assert_close(penalty, torch.tensor(expected, dtype=D), rtol=0, atol=1e-12)


def test_boundaries_of_the_ramp() -> None:
    # L_max = 10, L_cache = 4: free up to 6, then -1/4 per token, -1 at the limit.
    penalty = overlong_penalty(torch.tensor([6, 7, 8, 10, 11]), 10, 4, dtype=D)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -0.25, -0.5, -1.0, -1.0], dtype=D))


def test_penalty_factor_scales_and_buffer_zero_is_off() -> None:
    lengths = torch.tensor([3, 9, 10])
    torch.testing.assert_close(
        overlong_penalty(lengths, 10, 2, penalty_factor=0.5, dtype=D),
        torch.tensor([0.0, -0.25, -0.5], dtype=D),
    )
    assert torch.equal(overlong_penalty(lengths, 10, 0), torch.zeros(3))


def test_default_dtype_and_empty_batch() -> None:
    assert overlong_penalty(torch.tensor([5]), 10, 2).dtype == torch.get_default_dtype()
    assert overlong_penalty(torch.tensor([], dtype=torch.long), 10, 2).shape == (0,)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 10, 1.0), r"buffer \(10\) must be < max_new_tokens \(10\)"),
        ((10, -1, 1.0), "buffer must be >= 0"),
        ((10, 2, -0.5), "penalty_factor must be >= 0"),
    ],
)
def test_bad_arguments_are_rejected(args: tuple[int, int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        overlong_penalty(torch.tensor([1]), *args)
