"""A calculator task for agent demos: multiply two numbers, which a tiny model cannot do alone.

Each record is ``{"prompt": "23*45=", "question": "23*45=", "ground_truth": "1035",
"sft_target": [...]}`` (``prompt_template`` can wrap the question, e.g. in a chat template's
rendering).
``sft_target`` is the warm start's multi-turn target (``sft.target_key: sft_target``): for a
``tool_fraction`` of records a Hermes tool call to ``calculator``, the tool message (not
trained on) and the answer; for the others the bare answer, which the model can only guess.
RL then finds that calling the tool pays (:func:`calculator_answer` scores the final answer).

:func:`openai_calculator_agent` is the same task as agent code written for the ``openai``
client (``agent.function``): it offers the calculator through the chat API's ``tools``
parameter, runs the calls the policy makes and scores the final answer.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from hf_core.agents.config import QWEN_TOOL_RESPONSE
from hf_core.agents.tools import CALCULATOR_PARAMETERS, ToolError, calculator
from hf_core.data.io import write_jsonl
from hf_core.tool_calls import CLOSE, format_tool_call
from hf_testing.tiny import EOS


def make_calculator_task(
    n: int = 1000,
    seed: int = 0,
    tool_fraction: float = 0.5,
    low: int = 10,
    high: int = 99,
    template: str = QWEN_TOOL_RESPONSE,
    prompt_template: str = "{question}",
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
        question = f"{a}*{b}="
        records.append(
            {
                "prompt": prompt_template.format(question=question),
                "question": question,
                "ground_truth": answer,
                "sft_target": target,
            }
        )
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


CALCULATOR_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": CALCULATOR_PARAMETERS,
        },
    }
]
"""The calculator as the chat API's ``tools`` parameter describes it."""


async def openai_calculator_agent(client: Any, sample: dict[str, Any]) -> float:
    """Plain ``openai``-client agent code: ask the question with the calculator on offer, run
    each tool call the model makes and send the results back, until it answers (two requests
    at most); 1.0 when the final answer is the product."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample["question"]}]
    answer = ""
    for _ in range(2):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=CALCULATOR_TOOLS
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _calculate(call)})
    return float(answer.strip() == str(sample["ground_truth"]).strip())


def _calculate(call: Any) -> str:
    """The calculator's answer to one tool call (an error message for a bad one)."""
    try:
        arguments = json.loads(call.function.arguments)
        return calculator(str(arguments["expression"]))
    except (ToolError, KeyError, TypeError, json.JSONDecodeError) as exc:
        return f"error: {exc}"


async def unreliable_calculator_agent(client: Any, sample: dict[str, Any]) -> Any:
    """:func:`openai_calculator_agent` that fails on purpose, by the question's first factor:
    a multiple of 3 raises after one request, one more returns something that is not a reward;
    the others run normally (for tests that a failing agent costs its sample, not the step)."""
    first = int(str(sample["question"]).split("*", 1)[0])
    if first % 3 == 0:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": sample["question"]}]
        )
        raise RuntimeError("the agent crashed on purpose")
    if first % 3 == 1:
        return "not a reward"
    return await openai_calculator_agent(client, sample)
