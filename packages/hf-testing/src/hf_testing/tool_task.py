"""A calculator task for agent demos: multiply two numbers, which a tiny model cannot do alone.

Each record is ``{"prompt": "23*45=", "ground_truth": "1035", "sft_target": [...]}``.
``sft_target`` is the warm start's multi-turn target (``sft.target_key: sft_target``): for a
``tool_fraction`` of records a Hermes tool call to ``calculator``, the tool message (not
trained on) and the answer; for the others the bare answer, which the model can only guess.
RL then finds that calling the tool pays (:func:`calculator_answer` scores the final answer).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from hf_core.agents.config import QWEN_TOOL_RESPONSE
from hf_core.agents.tool_calls import CLOSE, format_tool_call
from hf_core.data.io import write_jsonl
from hf_testing.tiny import EOS


def make_calculator_task(
    n: int = 1000,
    seed: int = 0,
    tool_fraction: float = 0.5,
    low: int = 10,
    high: int = 99,
    template: str = QWEN_TOOL_RESPONSE,
) -> list[dict[str, Any]]:
    """``n`` products of two numbers in ``[low, high]`` with their SFT targets."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        answer = str(a * b)
        if rng.random() < tool_fraction:
            target = [
                {"text": format_tool_call("calculator", {"expression": f"{a}*{b}"}) + EOS},
                {"text": template.format(result=answer), "train": False},
                {"text": answer + EOS},
            ]
        else:
            target = [{"text": answer + EOS}]
        records.append({"prompt": f"{a}*{b}=", "ground_truth": answer, "sft_target": target})
    return records


def write_calculator_task(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """:func:`make_calculator_task` written as JSONL (atomically)."""
    return write_jsonl(make_calculator_task(**kwargs), path)


def final_answer(response: str) -> str:
    """The text after the last tool call (the whole response without one), stripped."""
    return response.rpartition(CLOSE)[2].strip()


def calculator_answer(
    responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
) -> list[float]:
    """1.0 when the final answer is the product, else 0.0 (reward for the calculator task)."""
    return [
        float(final_answer(r) == str(t).strip())
        for r, t in zip(responses, ground_truths, strict=True)
    ]
