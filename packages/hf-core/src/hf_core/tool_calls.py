"""Tool calls in the Hermes / Qwen convention, parsed from a model turn's text.

A call is a JSON object between tags, anywhere in the assistant's turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>

``arguments`` is an object (a JSON string holding an object is accepted too, as some models
write it).  A block that is not valid JSON, lacks ``name``, has non-object arguments or is
never closed is returned as a :class:`MalformedCall` whose message goes back to the model as
the tool's answer: the rollout never fails on what the model wrote.

Both the agent loop (:mod:`hf_core.agents.loop`) and the policy endpoint
(:mod:`hf_core.serving`, which returns a completion's calls as OpenAI ``tool_calls``) read
calls this way, so the parser sits below both: serving never imports the agents.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A ``<tool_call>`` block that could not be read; ``error`` says why (for the model)."""

    text: str
    error: str


def _parse_block(body: str) -> ToolCall | MalformedCall:
    text = body.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return MalformedCall(text, f"error: the tool call is not valid JSON ({e.msg})")
    if not isinstance(value, dict):
        return MalformedCall(text, "error: a tool call must be a JSON object")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(text, "error: the tool call has no 'name'")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return MalformedCall(text, "error: 'arguments' is a string that is not JSON")
    if not isinstance(arguments, dict):
        return MalformedCall(text, "error: 'arguments' must be a JSON object")
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every ``<tool_call>`` block of ``text`` in order (an unclosed last one is malformed)."""
    calls: list[ToolCall | MalformedCall] = [_parse_block(b) for b in _BLOCK.findall(text)]
    tail = _BLOCK.sub("", text)
    if OPEN in tail:
        unclosed = tail[tail.index(OPEN) + len(OPEN) :]
        calls.append(MalformedCall(unclosed.strip(), f"error: the tool call is not closed {CLOSE}"))
    return calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call in this convention (for SFT examples and tests)."""
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CLOSE}"
