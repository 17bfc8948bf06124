"""Preference rows (reward model, DPO) of common public datasets -> prompt / chosen / rejected.

``hybridflow data prepare preference`` (:mod:`hf_core.data.prepare` reads the files and writes
the outputs; this module converts one row).  Accepted rows:

* ``prompt`` + ``chosen`` + ``rejected``: each a string or a chat message list.  A string
  prompt is a user turn, a string reply an assistant turn.  Replies that are whole
  conversations starting with the prompt (UltraFeedback-binarized) have the prompt stripped.
* ``chosen`` + ``rejected`` alone, both message lists: whole conversations; their longest
  shared start is the prompt, the rest of each the reply.
* ``chosen`` + ``rejected`` alone, both strings: Anthropic HH transcripts
  (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``), split into turns; the shared turns (everything up
  to the last ``"\\n\\nAssistant:"`` in that dataset) are the prompt.  A ``prompt`` string
  that is an HH transcript ending with ``"\\n\\nAssistant:"`` is split the same way (its replies
  are the strings in ``chosen`` / ``rejected``).
* ``question`` + ``response_chosen`` + ``response_rejected``: as ``prompt`` / ``chosen`` /
  ``rejected``.

Output record: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages],
"source_row": i}`` (plus ``tools`` when the row has a list of them); each reply starts with an
assistant turn and ends with one (later turns are cut).  A pair with identical replies, a blank
prompt or reply, replies that part at a turn other than the assistant's, or a reply that does
not continue the given prompt is dropped and counted by reason.  Unknown roles, non-string
content and missing fields are malformed (:class:`~hf_core.errors.DataError` naming the file,
row and field).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hf_core.data.prepare_sft import (
    Messages,
    chat_messages,
    continuation,
    is_blank,
    last_assistant,
    render_messages,
    turns,
    with_system,
)
from hf_core.errors import DataError

_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}
#: (prompt, chosen, rejected) field names, in the order they are looked for.
PAIR_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("prompt", "chosen", "rejected"),
    ("question", "response_chosen", "response_rejected"),
)


def hh_messages(text: str, where: str, field: str) -> Messages:
    """An Anthropic HH transcript (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``) as chat turns,
    each one's text stripped."""
    parts = _HH_TURN.split("\n\n" + text.lstrip())
    if len(parts) < 3 or parts[0].strip():
        raise DataError(
            f"{where}: {field!r} is not an Anthropic HH transcript "
            "('\\n\\nHuman: ...\\n\\nAssistant: ...'); without a 'prompt' field, string "
            "'chosen' / 'rejected' must be one"
        )
    return [
        {"role": _HH_ROLES[speaker], "content": said.strip()}
        for speaker, said in zip(parts[1::2], parts[2::2], strict=True)
    ]


def _is_hh_prompt(value: Any) -> bool:
    """An HH transcript that stops at the reply's ``"\\n\\nAssistant:"`` (a ``prompt``
    column cut from HH, its replies in ``chosen`` / ``rejected``)."""
    return (
        isinstance(value, str)
        and value.lstrip().startswith("Human:")
        and value.rstrip().endswith("\n\nAssistant:")
    )


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """One turn in both replies: same role, text (up to surrounding blanks) and other keys."""
    rest_a = {k: v for k, v in a.items() if k != "content"}
    rest_b = {k: v for k, v in b.items() if k != "content"}
    return rest_a == rest_b and a["content"].strip() == b["content"].strip()


def _identical(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


def split_shared_prefix(
    chosen: Messages, rejected: Messages
) -> tuple[Messages, Messages, Messages] | str:
    """(prompt, chosen reply, rejected reply) of two whole conversations, their shared turns
    being the prompt; a reason to drop the pair when they do not part at an assistant turn."""
    if _identical(chosen, rejected):
        return "identical chosen and rejected"
    shared = 0
    while shared < min(len(chosen), len(rejected)) and _same(chosen[shared], rejected[shared]):
        shared += 1
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if shared == len(side):
            return f"empty {name}"
        if side[shared]["role"] != "assistant":
            return "chosen and rejected part at a turn other than the assistant's"
    if shared == 0:
        return "no shared prompt"
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _after_prompt(reply: Messages, prompt: Messages) -> Messages:
    """``reply`` without a leading copy of ``prompt`` (a whole conversation given as reply)."""
    if len(reply) > len(prompt) and _identical(reply[: len(prompt)], prompt):
        return reply[len(prompt) :]
    return reply


def _pair(values: Mapping[str, Any], where: str) -> tuple[Any, Any, Any, tuple[str, str, str]]:
    for names in PAIR_FIELDS:
        prompt, chosen, rejected = names
        if chosen in values and rejected in values:
            if prompt == "question" and prompt not in values:
                raise DataError(f"{where}: no 'question' field beside {chosen!r} / {rejected!r}")
            return values.get(prompt), values[chosen], values[rejected], names
    present = ", ".join(sorted(map(str, values))) or "none"
    raise DataError(
        f"{where}: no preference pair; the preference format reads 'chosen' + 'rejected' "
        f"(with or without 'prompt') or 'question' + 'response_chosen' + 'response_rejected' "
        f"(fields: {present})"
    )


def _split(values: Mapping[str, Any], where: str) -> tuple[Messages, Messages, Messages] | str:
    """(prompt, chosen, rejected) of a row, or why it is dropped (see the module doc)."""
    prompt_value, chosen_value, rejected_value, (p_name, c_name, r_name) = _pair(values, where)
    if prompt_value is None:
        if isinstance(chosen_value, str) and isinstance(rejected_value, str):
            chosen = hh_messages(chosen_value, where, c_name)
            rejected = hh_messages(rejected_value, where, r_name)
        elif isinstance(chosen_value, list | tuple) and isinstance(rejected_value, list | tuple):
            chosen = chat_messages(chosen_value, where, c_name)
            rejected = chat_messages(rejected_value, where, r_name)
        else:
            raise DataError(
                f"{where}: without a {p_name!r} field, {c_name!r} and {r_name!r} must both be "
                "HH transcripts (strings) or both whole conversations (message lists); got "
                f"{type(chosen_value).__name__} and {type(rejected_value).__name__}"
            )
        return split_shared_prefix(chosen, rejected)
    hh = _is_hh_prompt(prompt_value)
    if hh:  # its last turn is the reply's empty opening
        prompt = hh_messages(prompt_value, where, p_name)[:-1]
    else:
        prompt = turns(prompt_value, where, p_name, "user")
    replies = []
    for name, value in ((c_name, chosen_value), (r_name, rejected_value)):
        value = value.strip() if hh and isinstance(value, str) else value
        reply = _after_prompt(turns(value, where, name, "assistant"), prompt)
        if reply and reply[0]["role"] != "assistant":
            return f"{name} does not continue the prompt"
        replies.append(reply)
    return prompt, replies[0], replies[1]


def preference_record(
    values: Any, where: str, index: int, system: str | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """The ``{"prompt", "chosen", "rejected", "source_row"}`` record of one row, or ``(None,
    reason)`` when it is dropped; a malformed row raises :class:`~hf_core.errors.DataError`."""
    if not isinstance(values, Mapping):
        raise DataError(f"{where}: expected an object, got {type(values).__name__}")
    split = _split(values, where)
    if isinstance(split, str):
        return None, split
    prompt, chosen, rejected = split
    if not prompt or is_blank(prompt):
        return None, "empty prompt"
    if prompt[-1]["role"] == "assistant":
        return None, "prompt ends with an assistant turn"
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if not reply or is_blank([m for m in reply if m["role"] == "assistant"]):
            return None, f"empty {name}"
    chosen = chosen[: (last_assistant(chosen) or 0) + 1]
    rejected = rejected[: (last_assistant(rejected) or 0) + 1]
    if _identical(chosen, rejected):
        return None, "identical chosen and rejected"
    record: dict[str, Any] = {
        "prompt": with_system(prompt, system),
        "chosen": chosen,
        "rejected": rejected,
        "source_row": index,
    }
    tools = values.get("tools")
    if isinstance(tools, list) and tools:
        record["tools"] = tools
    return record, None


def preference_preview(record: Mapping[str, Any], tokenizer: Any) -> list[str]:
    """Preview lines of one pair: the prompt, then each reply as it follows the prompt."""
    prompt = record["prompt"]
    return [
        f"\n--- row {record['source_row']} prompt ---",
        render_messages(prompt, tokenizer, generation_prompt=True),
        "--- chosen ---",
        continuation(prompt, record["chosen"], tokenizer),
        "--- rejected ---",
        continuation(prompt, record["rejected"], tokenizer),
    ]
