"""Format rewards: 1.0 when a response has the shape a prompt asked for, else 0.0.

They check form only, not correctness; add them to a correctness reward (a function of your
own calling both) or use them alone early in training to teach the answer format.

* ``format_gsm8k``: a number follows the last ``####`` (``#### 1,234``, ``#### -3.5``).
* ``format_boxed``: exactly one ``\\boxed{...}``, non-empty, with balanced braces.  Several are a
  hedge (``\\boxed{1} or \\boxed{2}``), not the format: the math rewards read them as one set.
* ``format_think``: one ``<think>...</think>`` (non-empty) and then a non-empty answer, with no
  other think tag anywhere: a second block or a stray ``</think>`` makes "the answer" ambiguous.
"""

from __future__ import annotations

import re
from typing import Any

from hf_core.data.answers import last_boxed
from hf_core.rewards.registry import reward_function

_GSM8K_ANSWER = re.compile(r"####\s*[-+]?[\d,]*\.?\d+\s*$")
_THINK = re.compile(r"^\s*<think>(?P<thought>.*?)</think>(?P<answer>.*)$", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


@reward_function("format_gsm8k", batched=False)
def format_gsm8k(response: str, ground_truth: Any, extra: dict[str, Any]) -> float:
    """1.0 when the response ends with ``#### <number>``."""
    return float(bool(_GSM8K_ANSWER.search(response.strip())))


@reward_function("format_boxed", batched=False)
def format_boxed(response: str, ground_truth: Any, extra: dict[str, Any]) -> float:
    """1.0 when the response has exactly one ``\\boxed{...}``, non-empty and closed."""
    return float(len(_BOXED.findall(response)) == 1 and last_boxed(response) is not None)


@reward_function("format_think", batched=False)
def format_think(response: str, ground_truth: Any, extra: dict[str, Any]) -> float:
    """1.0 for ``<think>reasoning</think>answer`` with both parts non-empty and no other tag."""
    match = _THINK.match(response)
    if match is None:
        return 0.0
    parts = (match["thought"], match["answer"])
    return float(
        all(part.strip() for part in parts)
        and not any(tag in part for tag in ("<think>", "</think>") for part in parts)
    )
