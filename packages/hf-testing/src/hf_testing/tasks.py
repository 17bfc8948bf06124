"""A tiny synthetic task for the demo: reverse or sort a string of digits.

Each record is ``{"prompt": "reverse 90210:", "ground_truth": "01209"}`` (``"sort 90210:"`` /
``"00129"`` for sorting): the prompt follows the ``reverse <digits>: <answer>`` lines the
project's tiny tokenizer is trained on, and the ground truth is the answer the
``digits_reverse`` / ``digits_sort`` rewards score against.  Digits are uniform (leading zeros
allowed), lengths uniform in ``[min_len, max_len]``; the same arguments give the same records.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Literal

from hf_core.data.io import write_jsonl

DigitTaskKind = Literal["reverse", "sort"]


def make_digit_task(
    kind: DigitTaskKind = "reverse",
    n: int = 1000,
    min_len: int = 3,
    max_len: int = 6,
    seed: int = 0,
) -> list[dict[str, str]]:
    """``n`` records ``{"prompt": f"{kind} {digits}:", "ground_truth": answer}``."""
    if kind not in ("reverse", "sort"):
        raise ValueError(f"kind must be 'reverse' or 'sort', got {kind!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
        answer = digits[::-1] if kind == "reverse" else "".join(sorted(digits))
        records.append({"prompt": f"{kind} {digits}:", "ground_truth": answer})
    return records


def write_digit_task(
    path: str | os.PathLike[str],
    kind: DigitTaskKind = "reverse",
    n: int = 1000,
    min_len: int = 3,
    max_len: int = 6,
    seed: int = 0,
) -> Path:
    """Generate a digit task with :func:`make_digit_task` and write it as JSONL (atomically)."""
    return write_jsonl(make_digit_task(kind, n, min_len, max_len, seed), path)


def make_digit_demonstrations(
    kind: DigitTaskKind = "reverse",
    n: int = 1000,
    min_len: int = 3,
    max_len: int = 6,
    seed: int = 0,
) -> list[dict[str, str]]:
    """Supervised examples of the task: ``{"prompt": ..., "completion": answer}`` (the
    prompt/completion form ``hybridflow data prepare --format sft`` reads)."""
    return [
        {"prompt": r["prompt"], "completion": r["ground_truth"]}
        for r in make_digit_task(kind, n, min_len, max_len, seed)
    ]


def make_digit_preferences(
    kind: DigitTaskKind = "reverse",
    n: int = 1000,
    min_len: int = 3,
    max_len: int = 6,
    seed: int = 0,
) -> list[dict[str, str]]:
    """Preference pairs of the task: the right answer is ``chosen``; ``rejected`` is the same
    digits in the wrong order (the input as written, or a rotation when that is the answer),
    so a pair differs only in what the task scores."""
    pairs = []
    for record in make_digit_task(kind, n, min_len, max_len, seed):
        answer, digits = record["ground_truth"], record["prompt"].split()[1].rstrip(":")
        wrong = next(
            (c for c in (digits, digits[1:] + digits[:1], answer[1:] + answer[:1]) if c != answer),
            None,
        )
        if wrong is not None:  # every order of e.g. "777" is right: no pair
            pairs.append({"prompt": record["prompt"], "chosen": answer, "rejected": wrong})
    return pairs


def write_digit_demonstrations(path: str | os.PathLike[str], **kwargs: object) -> Path:
    """:func:`make_digit_demonstrations` as JSONL (atomically)."""
    return write_jsonl(make_digit_demonstrations(**kwargs), path)  # type: ignore[arg-type]


def write_digit_preferences(path: str | os.PathLike[str], **kwargs: object) -> Path:
    """:func:`make_digit_preferences` as JSONL (atomically)."""
    return write_jsonl(make_digit_preferences(**kwargs), path)  # type: ignore[arg-type]
