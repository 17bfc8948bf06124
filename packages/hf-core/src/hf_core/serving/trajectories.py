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
silent re-tokenisation.  Messages the template cannot render or text the tokenizer cannot
encode (a lone surrogate) are :class:`InvalidPrompt` (400), not a server error.

Nothing here changes a trajectory until the engine has answered:
:meth:`ChatRenderer.continuation` computes a request's new tokens, the endpoint checks them
against its limits, and :meth:`ChatRenderer.commit` records them with the completion, so a
refused or failed request leaves the trajectory as it was.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from hf_core.tool_calls import MalformedCall, parse_tool_calls


class ConversationEdited(ValueError):
    """A request's messages do not continue the trajectory's conversation."""


class TrajectoryLimit(ValueError):
    """A trajectory used up its requests or tokens."""


class InvalidPrompt(ValueError):
    """A prompt the engine must not see: empty, token ids outside the vocabulary, messages the
    chat template cannot render or text the tokenizer cannot encode."""


class PromptTooLong(ValueError):
    """A prompt (or a context) over the endpoint's prompt limit or the engine's capacity."""


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
    routed: Any = None
    """Routing replay: the ``[positions, moe layers, k]`` experts of the positions fed so far,
    each from the first completion that fed it
    (:func:`hf_core.engines.routed_experts.keep_first_routing`)."""
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
    arguments, whatever the ids and formatting the client echoes back); malformed ones (not
    objects, a ``tool_calls`` that is not a list) are compared as they are, not an error."""
    calls = []
    raw_calls = message.get("tool_calls") or []
    for call in raw_calls if isinstance(raw_calls, list) else [raw_calls]:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            calls.append((None, json.dumps(function, sort_keys=True)))
            continue
        calls.append((function.get("name"), _arguments_key(function.get("arguments"))))
    content = message.get("content")
    return {"role": message.get("role"), "content": content or "", "tool_calls": calls}


def _arguments_key(arguments: Any) -> str:
    """Tool-call arguments as compared: parsed when they are a JSON string (any nesting a
    string hides included: past the recursion limit they are compared as the string)."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        return json.dumps(parsed, sort_keys=True)
    except (ValueError, RecursionError):
        return json.dumps(arguments) if isinstance(arguments, str) else "?"


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
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=generation
                )
            )
        except Exception as exc:  # the client's messages, not the server, are at fault
            raise InvalidPrompt(
                f"the chat template cannot render the messages: {type(exc).__name__}: {exc}"
            ) from exc

    def encode(self, text: str) -> list[int]:
        try:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except (TypeError, ValueError) as exc:  # e.g. a lone surrogate from a JSON escape
            raise InvalidPrompt(f"the tokenizer cannot encode the text: {exc}") from exc

    def continuation(
        self, trajectory: Trajectory, messages: list[dict[str, Any]], tools: Any
    ) -> list[int]:
        """The tokens ``messages`` add to ``trajectory``: the rendered prompt on its first
        request, else the new messages' tokens (after checking that ``messages`` continue
        its conversation).  Changes nothing; :meth:`commit` records them."""
        known = trajectory.messages
        if not known:
            return self.encode(self.render(messages, tools, generation=True))
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
                    f"message {i} ({old.get('role')}) differs from the trajectory's: a "
                    "trajectory is one conversation and cannot be edited or branched"
                )
        before = self.render(known, tools, generation=False)
        after = self.render(messages, tools, generation=True)
        if not after.startswith(before):
            raise ConversationEdited("the chat template renders the earlier messages differently")
        glue = ""
        if known[-1].get("role") == "assistant":
            stopped = bool(trajectory.tokens) and trajectory.tokens[-1] in self.stop_ids
            glue = self._after_stop(before, include_stop=not stopped)
        return self.encode(glue + after[len(before) :])

    @staticmethod
    def commit(
        trajectory: Trajectory, messages: list[dict[str, Any]], tools: Any, ids: list[int]
    ) -> None:
        """Record what :meth:`continuation` computed: the prompt, or inserted tokens (loss
        mask 0), and the conversation so far."""
        if not trajectory.messages:
            trajectory.tools = tools
            trajectory.prompt = list(ids)
        else:
            trajectory.append(ids, None)
        trajectory.messages = list(messages)

    def extend(self, trajectory: Trajectory, messages: list[dict[str, Any]], tools: Any) -> None:
        """Check that ``messages`` continue ``trajectory`` and append the new ones' tokens."""
        self.commit(trajectory, messages, tools, self.continuation(trajectory, messages, tools))

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
