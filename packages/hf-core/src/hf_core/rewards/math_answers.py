"""Verifiable math rewards: final-answer extraction and symbolic equivalence by math-verify.

math-verify (with sympy underneath) extracts the answer a response states (a ``\\boxed{}``, a
``$...$`` expression, a plain number) and compares it with the reference symbolically, so
``0.5``, ``1/2`` and ``\\frac{1}{2}`` are one answer and ``0.6`` is not.  It is an optional
dependency: ``pip install 'hf-core[math]'``.

* ``math_verify``: 1.0 when the response's final answer equals the ground truth, else 0.0
  (MATH-style data: the ground truth is a LaTeX answer such as ``\\frac{1}{2}``).
* ``gsm8k``: the same check on what follows the response's last ``####`` (the format a GSM8K
  prompt asks for); 0.0 when the response has no ``####``.

A response states one answer, so listing candidates never earns credit for each of them:
several ``\\boxed{}``, or one holding ``1, 2, 3``, ``1 \\text{ or } 2`` or ``\\pm 2``, are read
as one set; an interval or an inequality is not a number; a chain (``x = 1 = 2 = 3``) or text
listing numbers counts as one of them only (tests: ``test_rewards_math.py``).

A ground truth that is a list counts as any of its items.  The library bounds its parsing and
comparison time with SIGALRM, which only the main thread may use; elsewhere (a reward called in
a worker thread) the limits are off.
"""

from __future__ import annotations

import threading
from typing import Any

from hf_core.data.answers import gsm8k_final_answer
from hf_core.errors import ConfigError
from hf_core.rewards.registry import reward_function

#: Seconds math-verify may spend parsing one text or comparing one pair (main thread only).
TIMEOUT_S = 5


def _library() -> Any:
    try:
        import math_verify
    except ImportError:
        raise ConfigError(
            "the math rewards need math-verify, which is not installed: pip install 'hf-core[math]'"
        ) from None
    return math_verify


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse_truth(truth: Any) -> list[Any]:
    """A reference answer as math-verify's parse list: read as LaTeX math (``$...$``), since
    references are bare answers (``72``, ``\\frac{1}{2}``) without the ``$`` anchors."""
    mv = _library()
    text = str(truth).strip()
    if not text:
        return []
    if not text.startswith("$") and "\\boxed" not in text:
        text = f"${text}$"
    parsed: list[Any] = mv.parse(text, parsing_timeout=_timeout())
    return parsed


def answers_match(response: str, truth: Any) -> bool:
    """Whether the final answer of ``response`` is symbolically equal to ``truth`` (or to one
    item of it, when it is a list)."""
    mv = _library()
    if truth is None:
        return False
    truths = truth if isinstance(truth, list | tuple) else [truth]
    answer = mv.parse(response, parsing_timeout=_timeout())
    if not answer:
        return False
    for option in truths:
        gold = _parse_truth(option)
        if gold and mv.verify(gold, answer, timeout_seconds=_timeout()):
            return True
    return False


@reward_function("math_verify", batched=False)
def math_verify_reward(response: str, ground_truth: Any, extra: dict[str, Any]) -> float:
    """1.0 when the response's final answer is symbolically the ground truth, else 0.0."""
    return float(answers_match(response, ground_truth))


@reward_function("gsm8k", batched=False)
def gsm8k_reward(response: str, ground_truth: Any, extra: dict[str, Any]) -> float:
    """1.0 when the answer after the response's last ``####`` equals the ground truth."""
    answer = gsm8k_final_answer(response)
    return 0.0 if not answer else float(answers_match(answer, ground_truth))
