"""Built-in rule rewards for the demo tasks (digit reversal / sorting) and exact match.

Partial credit (``digits_reverse``, ``digits_sort``, :func:`digit_partial_credit`), with
``s = response.strip()``, ``t = str(ground_truth).strip()`` (the expected digit string) and a
length tolerance ``tol`` (default :data:`LENGTH_TOLERANCE` = 2):

* ``s == t``                                  -> 1.0
* ``t`` empty, or ``s`` empty                 -> 0.0
* ``len(s) > len(t) + tol`` (runaway output)  -> 0.0
* otherwise: ``matches / max(len(s), len(t))`` where ``matches`` counts positions
  ``i < min(len(s), len(t))`` with ``s[i] == t[i]``.

So the score is the fraction of aligned characters that are right, a short answer loses the
missing positions, up to ``tol`` extra characters cost one position each, and anything longer
scores 0.  Characters that are not digits never match (the targets are digits), so a garbage
answer of the right length scores 0 too.  Uniform random digits of the right length score about
0.1.  Both tasks use the same rule against their own target (the reversed, resp. sorted,
digits); the ground truth is that target, as :func:`hf_testing.tasks.make_digit_task`
writes it.

``exact_match``: 1.0 when the stripped response equals the stripped ground truth (or one of
them, when the ground truth is a list), else 0.0.
"""

from __future__ import annotations

from typing import Any

from hf_core.rewards.registry import reward_function

#: Extra characters beyond the target's length that still earn partial credit.
LENGTH_TOLERANCE = 2


def digit_partial_credit(
    response: str, target: Any, length_tolerance: int = LENGTH_TOLERANCE
) -> float:
    """Partial credit in [0, 1] for ``response`` against the digit string ``target``."""
    s = response.strip()
    t = "" if target is None else str(target).strip()
    if s == t and t:
        return 1.0
    if not s or not t or len(s) > len(t) + length_tolerance:
        return 0.0
    matches = sum(1 for a, b in zip(s, t, strict=False) if a == b and b.isdigit())
    return matches / max(len(s), len(t))


def _partial_batch(responses: list[str], ground_truths: list[Any]) -> list[float]:
    return [digit_partial_credit(r, t) for r, t in zip(responses, ground_truths, strict=True)]


@reward_function("digits_reverse")
def digits_reverse(
    responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
) -> list[float]:
    """Digit reversal with partial credit (the ground truth is the reversed digit string)."""
    return _partial_batch(responses, ground_truths)


@reward_function("digits_sort")
def digits_sort(
    responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
) -> list[float]:
    """Digit sorting with partial credit (the ground truth is the sorted digit string)."""
    return _partial_batch(responses, ground_truths)


def _exact(response: str, truth: Any) -> float:
    if truth is None:
        return 0.0
    options = truth if isinstance(truth, list | tuple) else [truth]
    return float(any(response.strip() == str(option).strip() for option in options))


@reward_function("exact_match")
def exact_match(
    responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
) -> list[float]:
    """1.0 when the stripped response equals the (or one listed) ground truth, else 0.0."""
    return [_exact(r, t) for r, t in zip(responses, ground_truths, strict=True)]
