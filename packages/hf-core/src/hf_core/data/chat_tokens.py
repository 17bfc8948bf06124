"""Conversations -> token ids with loss masks, for supervised fine-tuning and preference pairs.

    prompt_ids, target_ids, target_mask = sft_example(messages, tokenizer)
    dataset = SFTDataset.from_files("data/sft/train.jsonl", tokenizer, max_length=1024)
    batch = dataset.collate([0, 1, 2])  # the layout of hf_core.trainer.batches.sft_batch

The prompt is the conversation before the reply (the first assistant turn for SFT, the given
prompt for a pair), rendered with ``apply_chat_template(add_generation_prompt=True)``: the
text a rollout engine would continue.  The target is the rest, and only the assistant's own
tokens are trained on (mask 1): its text, tool calls and end-of-turn token as the template
writes them; user, tool and system turns between replies, the next reply's header and the
blank the template writes after an end-of-turn token are read but not trained on (mask 0).
The target ends with the last reply's end-of-turn token, as a sampled response does.

Which tokens are whose is read off the chat template itself, so any template works: the
conversation's prefixes (``messages[:k]``) are rendered, each turn's tokens are those of the
text it adds, and the pieces must re-tokenize to the whole conversation's tokens.  A template
that rewrites earlier turns when a later one is added (not prefix-stable), or text whose
tokens merge across a turn boundary, raises a :class:`~hf_core.errors.DataError` naming the
row instead of training on misaligned masks.

Without a chat template a conversation must be one user turn and one assistant reply: the
prompt's text (with the tokenizer's default special tokens, as
:class:`~hf_core.data.dataset.PromptDataset` tokenizes it) and the reply's + EOS, as
:func:`~hf_core.trainer.batches.sft_batch` does.

Rows are read with :mod:`hf_core.data.prepare_sft` / :mod:`hf_core.data.prepare_pairs`, so
the datasets take ``hybridflow data prepare sft|preference`` output and the raw formats it
accepts alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

import numpy as np
import torch

from hf_core.batch import Batch
from hf_core.data.io import RecordLocation, read_records
from hf_core.data.prepare_pairs import preference_record
from hf_core.data.prepare_sft import first_assistant, last_assistant, sft_record
from hf_core.errors import DataError

logger = logging.getLogger("hf_core.data")

Message = Mapping[str, Any]
Target = tuple[list[int], list[int], list[int]]
"""(prompt ids, target ids, target mask)."""


# ----------------------------------------------------------------- rendering
def _has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(
    messages: Sequence[Message], tokenizer: Any, generation_prompt: bool, where: str, tools: Any
) -> str:
    try:
        return str(
            tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=tools,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        )
    except Exception as e:  # jinja2's own types, and templates' raise_exception
        raise DataError(f"{where}: the chat template cannot render the conversation: {e}") from e


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _end_markers(tokenizer: Any) -> tuple[str, ...]:
    """The special and added tokens' texts: an end-of-turn token is one of them."""
    tokens = set(getattr(tokenizer, "all_special_tokens", None) or ())
    tokens |= set(getattr(tokenizer, "added_tokens_encoder", None) or {})
    return tuple(sorted(t for t in tokens if t))


def _turn_end(text: str, markers: tuple[str, ...]) -> tuple[str, str]:
    """(trained, not trained) of an assistant turn's text: the blank a template writes after
    the end-of-turn token separates turns and is never sampled, so it is not trained on."""
    body = text.rstrip()
    if body != text and body.endswith(markers):
        return body, text[len(body) :]
    return text, ""


def _pieces(
    messages: Sequence[Message], split: int, tokenizer: Any, where: str, tools: Any
) -> tuple[str, list[tuple[str, int]]]:
    """The prompt's text (``messages[:split]`` + generation prompt) and the (text, trained)
    pieces that follow it, each the text one more turn (or reply header) adds."""
    done = prompt = _render(messages[:split], tokenizer, True, where, tools)
    markers = _end_markers(tokenizer)
    pieces: list[tuple[str, int]] = []
    opened = True  # the text so far ends with an assistant header

    def extend(text: str, k: int) -> str:
        if not text.startswith(done):
            raise DataError(
                f"{where}: the chat template is not prefix-stable: adding turn {k} "
                f"({messages[k]['role']}) changes the text of the turns before it, so the "
                "assistant's tokens cannot be told from the others'"
            )
        return text[len(done) :]

    for k in range(split, len(messages)):
        if messages[k]["role"] == "assistant":
            if not opened:  # two replies in a row: the second one's header is not trained
                header = _render(messages[:k], tokenizer, True, where, tools)
                pieces.append((extend(header, k), 0))
                done = header
            text = _render(messages[: k + 1], tokenizer, False, where, tools)
            trained, rest = _turn_end(extend(text, k), markers)
            pieces += [(trained, 1), (rest, 0)]
            opened = False
        else:
            opened = k + 1 < len(messages) and messages[k + 1]["role"] == "assistant"
            text = _render(messages[: k + 1], tokenizer, opened, where, tools)
            pieces.append((extend(text, k), 0))
        done = text
    return prompt, [(text, trained) for text, trained in pieces if text]


def _chat_target(
    messages: Sequence[Message], split: int, tokenizer: Any, where: str, tools: Any
) -> Target:
    prompt, pieces = _pieces(messages, split, tokenizer, where, tools)
    prompt_ids = _ids(tokenizer, prompt)
    target_ids: list[int] = []
    target_mask: list[int] = []
    for text, trained in pieces:
        ids = _ids(tokenizer, text)
        target_ids += ids
        target_mask += [trained] * len(ids)
    whole = _ids(tokenizer, prompt + "".join(text for text, _ in pieces))
    joined = prompt_ids + target_ids
    if whole != joined:
        at = next(
            (i for i, (a, b) in enumerate(zip(whole, joined, strict=False)) if a != b),
            min(len(whole), len(joined)),
        )
        raise DataError(
            f"{where}: the conversation tokenizes differently turn by turn than whole (first "
            f"at token {at} of {len(whole)}: text merges across a turn boundary), so the loss "
            "mask would be misaligned"
        )
    while target_mask and not target_mask[-1]:  # the blank after the last reply's end
        target_ids.pop()
        target_mask.pop()
    return prompt_ids, target_ids, target_mask


def _plain_target(
    prompt: Sequence[Message], reply: Sequence[Message], tokenizer: Any, where: str
) -> Target:
    """No chat template: the user's text, then the reply's text + EOS (all trained on)."""
    if (
        len(prompt) != 1
        or prompt[0]["role"] != "user"
        or len(reply) != 1
        or reply[0].get("tool_calls")
    ):
        raise DataError(
            f"{where}: the tokenizer has no chat template, and without one only a single user "
            "turn and a single plain assistant reply can be tokenized (roles: "
            f"{[m['role'] for m in [*prompt, *reply]]})"
        )
    prompt_ids = list(tokenizer(str(prompt[0]["content"]))["input_ids"])
    target = _ids(tokenizer, str(reply[0]["content"]))
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        target.append(int(eos))
    return prompt_ids, target, [1] * len(target)


def sft_example(
    messages: Sequence[Message], tokenizer: Any, *, tools: Any = None, where: str = "<example>"
) -> Target:
    """(prompt ids, target ids, target mask) of one conversation (see the module doc): the
    prompt is everything before the first assistant turn; turns after the last assistant
    turn are left out.  ``tools``: passed to the chat template; ``where`` names the row in
    errors."""
    first, last = first_assistant(messages), last_assistant(messages)
    if first is None or last is None:
        raise DataError(f"{where}: no assistant turn to train on")
    if first == 0:
        raise DataError(f"{where}: the conversation starts with an assistant turn (no prompt)")
    messages = list(messages[: last + 1])
    if not _has_template(tokenizer):
        return _plain_target(messages[:first], messages[first:], tokenizer, where)
    return _chat_target(messages, first, tokenizer, where, tools)


def preference_example(
    prompt_messages: Sequence[Message],
    chosen: Sequence[Message],
    rejected: Sequence[Message],
    tokenizer: Any,
    *,
    tools: Any = None,
    where: str = "<example>",
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, chosen mask, rejected ids, rejected mask): each reply
    tokenized after the shared prompt as :func:`sft_example` tokenizes a target."""
    prompt = list(prompt_messages)
    if not prompt:
        raise DataError(f"{where}: an empty prompt")
    out: list[Target] = []
    for name, reply in (("chosen", list(chosen)), ("rejected", list(rejected))):
        last = last_assistant(reply)
        if not reply or reply[0]["role"] != "assistant" or last is None:
            raise DataError(f"{where}: {name} must start with an assistant turn")
        conversation = prompt + reply[: last + 1]
        if _has_template(tokenizer):
            out.append(_chat_target(conversation, len(prompt), tokenizer, where, tools))
        else:
            out.append(_plain_target(prompt, conversation[len(prompt) :], tokenizer, where))
    (prompt_ids, chosen_ids, chosen_mask), (_, rejected_ids, rejected_mask) = out
    return prompt_ids, chosen_ids, chosen_mask, rejected_ids, rejected_mask


# ----------------------------------------------------------------- examples
@dataclass(frozen=True)
class SFTExample:
    """One tokenized conversation: the prompt, then the target and its loss mask."""

    prompt_ids: list[int]
    target_ids: list[int]
    target_mask: list[int]
    sample_index: int = 0
    """The record's 0-based position across the input files."""


@dataclass(frozen=True)
class PreferenceExample:
    """One tokenized pair: the shared prompt, then each reply and its loss mask."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    sample_index: int = 0


def _rollout_tensors(
    rows: Sequence[tuple[list[int], list[int], list[int]]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """(prompt, response, mask) rows as :func:`~hf_core.trainer.batches.sft_batch` lays them
    out: prompts left-padded, responses right-padded, positions counting real tokens."""
    if not rows:
        raise DataError("cannot collate an empty list of examples")
    prompt_width = max(len(p) for p, _, _ in rows)
    width = max(len(r) for _, r, _ in rows)
    shape = (len(rows), prompt_width)
    prompts = torch.full(shape, pad_token_id, dtype=torch.long)
    prompt_attention = torch.zeros(shape, dtype=torch.long)
    responses = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(rows), width), dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, response, mask) in enumerate(rows):
        start = prompt_width - len(prompt)
        prompts[i, start:] = torch.tensor(prompt, dtype=torch.long)
        prompt_attention[i, start:] = 1
        responses[i, : len(response)] = torch.tensor(response, dtype=torch.long)
        response_mask[i, : len(response)] = torch.tensor(mask, dtype=torch.long)
        real[i, : len(response)] = 1
    attention = torch.cat([prompt_attention, real], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
    }


def sft_examples_batch(examples: Sequence[SFTExample], pad_token_id: int) -> Batch:
    """SFT examples as one rollout-shaped batch (the keys and layout of
    :func:`~hf_core.trainer.batches.sft_batch`), the target being the response."""
    rows = [(e.prompt_ids, e.target_ids, e.target_mask) for e in examples]
    return Batch(_rollout_tensors(rows, pad_token_id))


def preference_examples_batch(examples: Sequence[PreferenceExample], pad_token_id: int) -> Batch:
    """Pairs as one rollout-shaped batch: row ``2i`` is pair ``i``'s chosen reply, ``2i + 1``
    its rejected one; ``pair_side`` (+1 chosen, -1 rejected) and ``pair_index`` (``i``) say
    which, so a pairwise loss can line the two rows up."""
    rows = []
    for e in examples:
        rows += [(e.prompt_ids, e.chosen_ids, e.chosen_mask)]
        rows += [(e.prompt_ids, e.rejected_ids, e.rejected_mask)]
    tensors = _rollout_tensors(rows, pad_token_id)
    tensors["pair_side"] = torch.tensor([1, -1] * len(examples), dtype=torch.long)
    tensors["pair_index"] = torch.arange(len(examples), dtype=torch.long).repeat_interleave(2)
    return Batch(tensors)


# ----------------------------------------------------------------- datasets
E = TypeVar("E", SFTExample, PreferenceExample)


def _pad_id(tokenizer: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    raise DataError("the tokenizer has neither a pad token nor an EOS token to pad with")


class _ChatDataset(Generic[E]):
    """Rows tokenized once; dropped rows (blank, identical pair, over ``max_length`` tokens)
    counted by reason in ``dropped`` and logged, malformed ones raising."""

    kind = "examples"

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        max_length: int | None = None,
        system: str | None = None,
        locations: Sequence[RecordLocation] | None = None,
        name: str = "<records>",
    ) -> None:
        if max_length is not None and max_length < 1:
            raise DataError(f"max_length must be >= 1, got {max_length}")
        if locations is not None and len(locations) != len(records):
            raise DataError(f"{len(locations)} locations for {len(records)} records")
        self.name = name
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.system = system
        self.pad_token_id = _pad_id(tokenizer)
        self.num_records = len(records)
        self.dropped: Counter[str] = Counter()
        self._fingerprint: str | None = None
        self.items: list[E] = []
        for i, record in enumerate(records):
            where = str(locations[i]) if locations is not None else f"{name}: record {i}"
            example = self._example(record, where, i)
            if isinstance(example, str):
                self.dropped[example] += 1
            elif max_length is not None and self._length(example) > max_length:
                self.dropped[f"longer than max_length={max_length} tokens"] += 1
            else:
                self.items.append(example)
        reasons = "; ".join(f"{n} {why}" for why, n in sorted(self.dropped.items()))
        if self.dropped:
            logger.warning(
                "%s: dropped %d of %d rows (%s)",
                name,
                sum(self.dropped.values()),
                self.num_records,
                reasons,
            )
        if not self.items:
            raise DataError(f"{name}: no {self.kind} left ({reasons or 'the dataset is empty'})")

    @classmethod
    def from_files(
        cls,
        paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        tokenizer: Any,
        **kwargs: Any,
    ) -> Self:
        """Read JSONL / JSON / Parquet file(s) and tokenize every row."""
        located = read_records(paths)
        names = [str(paths)] if isinstance(paths, str | os.PathLike) else [str(p) for p in paths]
        name = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} more)"
        return cls(
            [r for r, _ in located],
            tokenizer,
            locations=[loc for _, loc in located],
            name=name,
            **kwargs,
        )

    def _example(self, record: Mapping[str, Any], where: str, index: int) -> E | str:
        raise NotImplementedError

    def _length(self, example: E) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> E:
        return self.items[index]

    @property
    def fingerprint(self) -> str:
        """A hash of every kept example's token ids and masks: a resumed loader checks it
        (the data, tokenizer, template or filter changed)."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for item in self.items:
                for field in dataclasses.fields(item):
                    value = getattr(item, field.name)
                    if isinstance(value, list | tuple):
                        digest.update(np.asarray(value, dtype=np.int64).tobytes())
                    digest.update(b"|")
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    @property
    def num_filtered(self) -> int:
        return sum(self.dropped.values())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, {len(self)} {self.kind}, "
            f"{self.num_filtered} dropped)"
        )


class SFTDataset(_ChatDataset[SFTExample]):
    """SFT conversations (see :mod:`hf_core.data.prepare_sft` for the rows it reads), each an
    :class:`SFTExample`; ``max_length`` bounds prompt + target tokens."""

    kind = "conversations"

    def _example(self, record: Mapping[str, Any], where: str, index: int) -> SFTExample | str:
        row, reason = sft_record(record, where, index, self.system)
        if row is None:
            return reason or "dropped"
        tokens = sft_example(row["messages"], self.tokenizer, tools=row.get("tools"), where=where)
        return SFTExample(*tokens, sample_index=index)

    def _length(self, example: SFTExample) -> int:
        return len(example.prompt_ids) + len(example.target_ids)

    def collate(self, indices: Sequence[int]) -> Batch:
        """The examples at ``indices`` as one batch (:func:`sft_examples_batch`)."""
        return sft_examples_batch([self.items[int(i)] for i in indices], self.pad_token_id)


class PreferenceDataset(_ChatDataset[PreferenceExample]):
    """Preference pairs (see :mod:`hf_core.data.prepare_pairs` for the rows it reads), each a
    :class:`PreferenceExample`; ``max_length`` bounds prompt + the longer reply's tokens."""

    kind = "pairs"

    def _example(
        self, record: Mapping[str, Any], where: str, index: int
    ) -> PreferenceExample | str:
        row, reason = preference_record(record, where, index, self.system)
        if row is None:
            return reason or "dropped"
        tokens = preference_example(
            row["prompt"],
            row["chosen"],
            row["rejected"],
            self.tokenizer,
            tools=row.get("tools"),
            where=where,
        )
        return PreferenceExample(*tokens, sample_index=index)

    def _length(self, example: PreferenceExample) -> int:
        return len(example.prompt_ids) + max(len(example.chosen_ids), len(example.rejected_ids))

    def collate(self, indices: Sequence[int]) -> Batch:
        """The pairs at ``indices`` as one batch (:func:`preference_examples_batch`)."""
        return preference_examples_batch([self.items[int(i)] for i in indices], self.pad_token_id)
