"""Rewards that move an untrained policy (for the tests and benches that need its weights to
change: resuming, staleness, self-healing).

``digits_reverse`` scores the tiny random policy's responses 0 almost everywhere, so GRPO's
group advantages are 0 and an update leaves the weights as they were: a test of staleness or
of resuming would then compare identical policies and could not fail.
"""


def digit_share(responses: list[str], ground_truths: list, extras: dict) -> list[float]:
    """The share of digits among each response's characters: varies within every group."""
    return [sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses]
