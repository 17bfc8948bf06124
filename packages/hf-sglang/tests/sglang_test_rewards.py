"""A rule-based reward for the GRPO test that a random tiny model already spreads out.

``digits_reverse`` scores (almost) every sample of a random model 0, so GRPO's group-normalised
advantages are all 0 and the actor never moves; the share of distinct characters differs
between samples of one prompt, so updates (and the weight syncs they cause) change the policy.
"""

from __future__ import annotations

from typing import Any


def distinct_chars(
    responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
) -> list[float]:
    """Fraction of distinct characters in each response (0 for an empty one)."""
    return [len(set(text)) / len(text) if text else 0.0 for text in responses]
