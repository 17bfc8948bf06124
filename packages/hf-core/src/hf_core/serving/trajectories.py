"""Token-exact trajectories behind the OpenAI-compatible endpoint.

An agent talks to the policy through chat messages; training needs the exact token ids that
were sampled.  Re-tokenising the conversation at the end would not give them back (a BPE merge
across a turn boundary, a template that renders an assistant message differently from what
was sampled), so each trajectory keeps one growing token sequence instead:

* the first request's messages are rendered with the chat template (with the generation
  prompt) and tokenised: the trajectory's prompt;
* each completion appends the sampled ids exactly as the engine returned them (loss mask 1,
  with their log-probs and the policy version that sampled them);
* each later request must repeat the conversation so far unchanged (assistant messages as
  this server returned them); only its new messages are rendered -- the template's text for
  the whole conversation minus its text for the conversation so far -- and appended with loss
  mask 0.  The template's text after an assistant turn's stop token (ChatML: a newline) is
  part of that insert, since the sampled ids end at the stop token.

A request that edits an earlier message gets :class:`ConversationEdited` (HTTP 400), never a
silent re-tokenisation.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from hf_core.agents.tool_calls import MalformedCall, parse_tool_calls


class ConversationEdited(ValueError):
    """A request's messages do not continue the trajectory's conversation."""


class TrajectoryLimit(ValueError):
    """A trajectory used up its requests or tokens."""


@dataclass
class Trajectory:
    """One conversation as tokens: prompt, then sampled and inserted tokens."""

    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    """After the prompt: sampled tokens and the template's tokens for inserted messages."""
    sampled: list[int] = field(default_factory=list)
    """Per token of ``tokens``: 1 if the engine sampled it (the loss trains on it)."""
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per token of ``tokens``: the policy version that sampled it (-1: inserted)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation so far, assistant turns as this server returned them."""
    tools: Any = None
    requests: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One request of a trajectory at a time (the server's event loop)."""

    def append(self, ids: list[int], log_probs: list[float] | None, version: int = -1) -> None:
        self.tokens += ids
        self.sampled += [0 if log_probs is None else 1] * len(ids)
        self.log_probs += [0.0] * len(ids) if log_probs is None else log_probs
        self.versions += [version if log_probs is not None else -1] * len(ids)

    @property
    def context(self) -> list[int]:
        """What the next completion continues: the prompt and everything after it."""
        return self.prompt + self.tokens


def _canonical(message: dict[str, Any]) -> dict[str, Any]:
    """A message as compared between requests: role, content and tool calls (name and
    arguments, whatever the ids and formatting the client echoes back)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    content = message.get("content")
    return {"role": message.get("role"), "content": content or "", "tool_calls": calls}


class ChatRenderer:
    """Renders messages with the tokenizer's chat template, and turns into messages."""

    def __init__(self, tokenizer: Any, stop_token_ids: list[int]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the OpenAI endpoint needs a tokenizer with a chat template "
                "(tokenizer_config.json 'chat_template')"
            )
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_token_ids)
        self.stop_texts = [tokenizer.decode([t]) for t in stop_token_ids]

    def render(self, messages: list[dict[str, Any]], tools: Any, *, generation: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation
            )
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def extend(self, trajectory: Trajectory, messages: list[dict[str, Any]], tools: Any) -> None:
        """Check that ``messages`` continue ``trajectory`` and append the new ones' tokens."""
        known = trajectory.messages
        if not known:
            trajectory.tools = tools
            trajectory.prompt = self.encode(self.render(messages, tools, generation=True))
            trajectory.messages = list(messages)
            return
        if tools != trajectory.tools:
            raise ConversationEdited("the tools changed within a trajectory")
        if len(messages) <= len(known):
            raise ConversationEdited(
                f"the request repeats {len(messages)} messages and adds none; the trajectory "
                f"has {len(known)}"
            )
        for i, (old, new) in enumerate(zip(known, messages, strict=False)):
            if _canonical(old) != _canonical(new):
                raise ConversationEdited(
                    f"message {i} ({old.get('role')}) differs from the trajectory's; start a new "
                    "trajectory to branch a conversation"
                )
        before = self.render(known, tools, generation=False)
        after = self.render(messages, tools, generation=True)
        if not after.startswith(before):
            raise ConversationEdited("the chat template renders the earlier messages differently")
        glue = ""
        if known[-1].get("role") == "assistant":
            stopped = bool(trajectory.tokens) and trajectory.tokens[-1] in self.stop_ids
            glue = self._after_stop(before, include_stop=not stopped)
        trajectory.append(self.encode(glue + after[len(before) :]), None)
        trajectory.messages = list(messages)

    def _after_stop(self, rendered: str, *, include_stop: bool) -> str:
        """The template's text after the last assistant turn's stop token, where the sampled
        ids end; with ``include_stop`` (the turn was cut at a token limit, so the model never
        wrote its stop token) the stop token's text too, as the template closes the turn."""
        found = [(rendered.rfind(s), s) for s in self.stop_texts if s in rendered]
        if not found:
            return ""
        start, stop = max(found)
        return rendered[start if include_stop else start + len(stop) :]

    def assistant_message(self, text: str) -> tuple[dict[str, Any], str]:
        """The chat message for a sampled turn (Hermes ``<tool_call>`` blocks become
        ``tool_calls``) and its finish reason."""
        for stop in self.stop_texts:
            if text.endswith(stop):
                text = text[: -len(stop)]
        calls = [c for c in parse_tool_calls(text) if not isinstance(c, MalformedCall)]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if not calls:
            return message, "stop"
        start = text.find("<tool_call>")
        message["content"] = text[:start] if start > 0 else None
        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(calls)
        ]
        return message, "tool_calls"
