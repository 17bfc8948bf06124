"""Float64 tensors for the algorithm tests: expected values are worked out by hand, so the
tests compare at float64 precision."""

from __future__ import annotations

import torch

D = torch.float64


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def close(actual: torch.Tensor, expected: list | torch.Tensor, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=D), atol=atol, rtol=0)
