"""Supervised fine-tuning rows of common public datasets -> one chat ``messages`` record.

``hybridflow data prepare sft`` (:mod:`hf_core.data.prepare` reads the files, writes the
outputs and the report; this module converts one row).  Accepted rows, checked in this order:

* ``messages``: OpenAI / Hugging Face chat messages (roles ``system``, ``user``,
  ``assistant``, ``tool``; an assistant turn with ``tool_calls`` may have ``content: null``).
  The other keys of a message (``tool_calls``, ``tool_call_id``, ``name``, ...) are kept.
* ``conversations``: ShareGPT turns ``{"from": ..., "value": ...}`` with ``from`` one of
  ``human`` / ``user``, ``gpt`` / ``assistant`` / ``chatgpt``, ``system``, ``tool`` /
  ``observation``.
* ``prompt`` + ``completion``: strings (a user turn and an assistant turn), or message lists
  (TRL's conversational prompt-completion form).
* ``instruction`` (+ ``input``) + ``output``: Alpaca; a non-empty input follows the
  instruction after a blank line in the user turn.

Output record: ``{"messages": [...], "source_row": i}`` (plus the row's ``tools`` list when it
has one, for chat templates that declare tools).  A conversation needs a turn before its
first assistant turn and at least one assistant turn; turns after the last assistant turn
teach nothing and are cut.  An unknown role, non-string content, a row without any of the
accepted fields or without an assistant turn is malformed (:class:`~hf_core.errors.DataError`
naming the file, row and field); a row whose prompt or replies are all blank is dropped and
counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hf_core.errors import DataError

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
#: ShareGPT ``from`` values -> chat roles.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
}
Messages = list[dict[str, Any]]


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _fields(values: Mapping[str, Any]) -> str:
    return ", ".join(sorted(map(str, values))) or "none"


def chat_messages(value: Any, where: str, field: str) -> Messages:
    """``value`` checked as a list of chat messages (copies, ``None``-valued keys dropped:
    Parquet gives every message every key of the column's struct)."""
    if not isinstance(value, list | tuple):
        raise DataError(f"{where}: {field!r} must be a list of messages, got {_kind(value)}")
    out: Messages = []
    for i, message in enumerate(value):
        name = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise DataError(f"{where}: {name} must be an object, got {_kind(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(
                f"{where}: {name}.role: unknown role {role!r}; expected one of {', '.join(ROLES)}"
            )
        content = message.get("content")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list | tuple):
            raise DataError(f"{where}: {name}.tool_calls must be a list, got {_kind(tool_calls)}")
        if content is None and role == "assistant" and tool_calls:
            content = ""  # a turn that only calls tools (OpenAI writes content: null)
        if not isinstance(content, str):
            raise DataError(f"{where}: {name}.content must be a string, got {_kind(content)}")
        extra = {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}
        if "tool_calls" in extra:
            extra["tool_calls"] = list(extra["tool_calls"])
        out.append({"role": role, "content": content, **extra})
    return out


def sharegpt_messages(value: Any, where: str, field: str = "conversations") -> Messages:
    """ShareGPT ``[{"from": ..., "value": ...}]`` turns as chat messages."""
    if not isinstance(value, list | tuple):
        raise DataError(f"{where}: {field!r} must be a list of turns, got {_kind(value)}")
    out: Messages = []
    for i, turn in enumerate(value):
        name = f"{field}[{i}]"
        if not isinstance(turn, Mapping):
            raise DataError(f"{where}: {name} must be an object, got {_kind(turn)}")
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise DataError(
                f"{where}: {name}.from: unknown speaker {speaker!r}; expected one of "
                f"{', '.join(SHAREGPT_ROLES)}"
            )
        text = turn.get("value")
        if not isinstance(text, str):
            raise DataError(f"{where}: {name}.value must be a string, got {_kind(text)}")
        out.append({"role": SHAREGPT_ROLES[speaker], "content": text})
    return out


def _string(values: Mapping[str, Any], key: str, where: str) -> str:
    value = values[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {_kind(value)}")
    return value


def turns(value: Any, where: str, field: str, role: str) -> Messages:
    """A string as one ``role`` turn, or a message list checked as such."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return chat_messages(value, where, field)


def _alpaca(values: Mapping[str, Any], where: str) -> Messages:
    instruction = _string(values, "instruction", where)
    extra = values.get("input")
    if extra is not None and not isinstance(extra, str):
        raise DataError(f"{where}: 'input' must be a string, got {_kind(extra)}")
    user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": _string(values, "output", where)},
    ]


def sft_messages(values: Any, where: str) -> tuple[Messages, str]:
    """The row's conversation as chat messages, and the field it came from (see the module
    doc for the accepted fields); checks roles and content types, not blank text."""
    if not isinstance(values, Mapping):
        raise DataError(f"{where}: expected an object, got {_kind(values)}")
    if "messages" in values:
        return chat_messages(values["messages"], where, "messages"), "messages"
    if "conversations" in values:
        return sharegpt_messages(values["conversations"], where), "conversations"
    if "prompt" in values and "completion" in values:
        prompt = turns(values["prompt"], where, "prompt", "user")
        completion = turns(values["completion"], where, "completion", "assistant")
        if completion and completion[0]["role"] != "assistant":
            raise DataError(
                f"{where}: completion[0].role: the completion must start with an assistant "
                f"turn, got {completion[0]['role']!r}"
            )
        return prompt + completion, "prompt"
    if "instruction" in values and "output" in values:
        return _alpaca(values, where), "instruction"
    raise DataError(
        f"{where}: no conversation; the sft format reads 'messages', 'conversations', "
        f"'prompt' + 'completion' or 'instruction' (+ 'input') + 'output' (fields: "
        f"{_fields(values)})"
    )


def with_system(messages: Messages, system: str | None) -> Messages:
    """``messages`` with a system turn first (``--system``) unless they have one."""
    if system is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system}, *messages]


def is_blank(messages: Sequence[Mapping[str, Any]]) -> bool:
    """No text and no tool call in any of ``messages``."""
    return all(not m["content"].strip() and not m.get("tool_calls") for m in messages)


def first_assistant(messages: Sequence[Mapping[str, Any]]) -> int | None:
    return next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)


def last_assistant(messages: Sequence[Mapping[str, Any]]) -> int | None:
    found = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return found[-1] if found else None


def sft_record(
    values: Any, where: str, index: int, system: str | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """The ``{"messages", "source_row"}`` record of one row, or ``(None, reason)`` when it is
    dropped; a malformed row raises :class:`~hf_core.errors.DataError`."""
    messages, field = sft_messages(values, where)
    first, last = first_assistant(messages), last_assistant(messages)
    if first is None or last is None:
        raise DataError(f"{where}: {field!r}: no assistant turn to train on")
    if first == 0:
        raise DataError(
            f"{where}: {field}[0].role: the conversation starts with an assistant turn; SFT "
            "needs a prompt (a user or system turn) before it"
        )
    messages = messages[: last + 1]
    if is_blank(messages[:first]):
        return None, "empty prompt"
    if is_blank([m for m in messages if m["role"] == "assistant"]):
        return None, "empty assistant reply"
    record: dict[str, Any] = {"messages": with_system(messages, system), "source_row": index}
    tools = values.get("tools")
    if isinstance(tools, list) and tools:
        record["tools"] = tools
    return record, None


# ------------------------------------------------------------------ preview
def render_messages(
    messages: Sequence[Mapping[str, Any]], tokenizer: Any, *, generation_prompt: bool = False
) -> str:
    """``messages`` as the model reads them: through the chat template when the tokenizer has
    one, else one ``[role] content`` line each (a template error is shown, not raised: the
    preview is written after the data)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            return str(
                tokenizer.apply_chat_template(
                    list(messages), add_generation_prompt=generation_prompt, tokenize=False
                )
            )
        except Exception as e:  # jinja2 raises its own types (and templates raise_exception)
            return f"(the chat template failed: {e})"
    return "\n".join(f"[{m['role']}] {m['content']}" for m in messages)


def continuation(
    prompt: Sequence[Mapping[str, Any]], reply: Sequence[Mapping[str, Any]], tokenizer: Any
) -> str:
    """The text ``reply`` adds after the rendered ``prompt`` (its own rendering when the
    template does not extend the prompt's)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return render_messages(reply, None)
    head = render_messages(prompt, tokenizer, generation_prompt=True)
    whole = render_messages([*prompt, *reply], tokenizer)
    return whole[len(head) :] if whole.startswith(head) else whole


def sft_preview(record: Mapping[str, Any], tokenizer: Any) -> list[str]:
    """Preview lines of one SFT record: the prompt, then what is trained on after it."""
    messages = record["messages"]
    first = first_assistant(messages) or 0
    return [
        f"\n--- row {record['source_row']} prompt ---",
        render_messages(messages[:first], tokenizer, generation_prompt=True),
        "--- target (assistant turns trained on, the others only read) ---",
        continuation(messages[:first], messages[first:], tokenizer),
    ]
