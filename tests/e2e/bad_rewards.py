"""A reward function that fails on one sample (for the bad-input tests)."""


def explode_on_long(responses: list[str], ground_truths: list, extras: dict) -> list[float]:
    if any(len(r) > 0 for r in responses):
        raise ValueError("cannot score this")
    return [0.0] * len(responses)


NOT_A_FUNCTION = "a reward function path must name a callable; this is a string"
