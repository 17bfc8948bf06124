"""Final answers inside reference solutions and responses: GSM8K's ``#### N`` and LaTeX's last
``\\boxed{...}``.  Shared by the dataset converter (ground truths) and the rewards (responses);
the standard library only."""

from __future__ import annotations

import re

GSM8K_MARK = "####"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def gsm8k_final_answer(text: str) -> str | None:
    """The text after the last ``####`` without thousands separators; ``None`` if absent/empty."""
    if GSM8K_MARK not in text:
        return None
    final = text.rsplit(GSM8K_MARK, 1)[1].strip().replace(",", "")
    return final or None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` (nested braces
    balanced); ``None`` when there is none, it is empty, or its braces never close."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip() or None
    return None
