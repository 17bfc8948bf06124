"""Format rewards: 1.0 when a response has the shape a prompt asked for, else 0.0.

They check form only, not correctness; add them to a correctness reward (a function of your
own calling both) or use them alone early in training to teach the answer format.

* ``format_gsm8k``: a number follows the last ``####`` (``#### 1,234``, ``#### -3.5``).
* ``format_boxed``: a non-empty ``\\boxed{...}`` with balanced braces.
* ``format_think``: ``<think>...</think>`` (non-empty) and then a non-empty answer.
"""

from __future__ import annotations

import re
from typing import Any

from hf_core.data.answers import last_boxed
from hf_core.rewards.registry import reward_function

_GSM8K_ANSWER = re.compile(r"####\s*[-+]?[\d,]*\.?\d+\s*$")
_THINK = re.compile(r"^\s*<think>(?P<thought>.*?)</think>(?P<answer>.*)$", re.DOTALL)


@reward_function("format_gsm8k", batched=False)
def format_gsm8k(response: str, ground_truth: Any, extra: dict[str, Any]) -> float:
    """1.0 when the response ends with ``#### <number>``."""
    return float(bool(_GSM8K_ANSWER.search(response.strip())))


@reward_function("format_boxed", batched=False)
def format_boxed(response: str, ground_truth: Any, extra: dict[str, Any]) -> float:
    """1.0 when the response has a non-empty, closed ``\\boxed{...}``."""
    return float(last_boxed(response) is not None)


@reward_function("format_think", batched=False)
def format_think(response: str, ground_truth: Any, extra: dict[str, Any]) -> float:
    """1.0 for ``<think>reasoning</think>answer`` with both parts non-empty."""
    match = _THINK.match(response)
    return float(
        match is not None
        and bool(match["thought"].strip())
        and bool(match["answer"].strip())
        and "<think>" not in match["answer"]
    )
