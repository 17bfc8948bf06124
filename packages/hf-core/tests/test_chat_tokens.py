"""Conversations -> token ids and loss masks: only the assistant's tokens (its text, tool calls
and end-of-turn token) are trained on, whatever the template; templates that would misalign
the masks are refused naming the row; batches have sft_batch's layout."""

from __future__ import annotations

import copy
import json
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_core.batch import Batch
from hf_core.data import PromptDataset
from hf_core.data.chat_tokens import (
    PreferenceDataset,
    SFTDataset,
    preference_example,
    sft_example,
)
from hf_core.errors import DataError
from hf_core.trainer.batches import sft_batch

TOOL_CALL = {
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "12+34"}'},
}
CONVERSATION = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "What is 12+34?"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": "46"},
    {"role": "assistant", "content": "46."},
    {"role": "user", "content": "and 1+1?"},
    {"role": "assistant", "content": "2."},
]


@pytest.fixture(scope="module")
def plain() -> Any:
    """The tiny tokenizer without a chat template."""
    from hf_testing.tiny import build_tokenizer

    return build_tokenizer(256, tool_calls=True)


@pytest.fixture
def chat(plain: Any) -> Any:
    """The tiny tokenizer with its ChatML-style template (assistant turns end with EOS)."""
    from hf_testing.tiny import CHAT_TEMPLATE

    tokenizer = copy.deepcopy(plain)  # tests change the template
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _spans(tokenizer: Any, ids: list[int], mask: list[int]) -> list[tuple[int, str]]:
    """(mask, decoded text) of each run of equal mask values."""
    return [
        (trained, tokenizer.decode([i for i, _ in run]))
        for trained, run in groupby(zip(ids, mask, strict=True), key=lambda x: x[1])
    ]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _check_layout(batch: Batch, pad: int) -> None:
    """sft_batch's layout: left-padded prompts, right-padded responses, positions of real
    tokens counting from 0."""
    prompts, responses = batch["prompts"], batch["responses"]
    assert torch.equal(batch["input_ids"], torch.cat([prompts, responses], dim=1))
    attention = batch["attention_mask"]
    width = prompts.shape[1]
    for row in range(len(batch)):
        prompt_real = attention[row, :width]
        response_real = attention[row, width:]
        # left padding: zeros then ones; right padding: ones then zeros
        assert torch.equal(prompt_real, prompt_real.sort().values)
        assert torch.equal(response_real, response_real.sort(descending=True).values)
        assert (prompts[row][prompt_real == 0] == pad).all()
        assert (responses[row][response_real == 0] == pad).all()
        assert (batch["response_mask"][row][response_real == 0] == 0).all()
    assert torch.equal(batch["position_ids"], (attention.cumsum(-1) - 1).clamp(min=0))


def test_only_the_assistant_turns_are_trained_on(chat: Any) -> None:
    prompt_ids, target_ids, mask = sft_example(CONVERSATION, chat)
    assert chat.decode(prompt_ids) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 12+34?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert _spans(chat, target_ids, mask) == [
        (
            1,
            '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}'
            "</tool_call><|endoftext|>",
        ),
        (
            0,
            "\n<|im_start|>user\n<tool_response>\n46\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (1, "46.<|endoftext|>"),
        (0, "\n<|im_start|>user\nand 1+1?<|im_end|>\n<|im_start|>assistant\n"),
        (1, "2.<|endoftext|>"),
    ]
    # the pieces are the whole conversation's tokens (less the blank after the last reply)
    whole = chat.apply_chat_template(CONVERSATION, tokenize=False)
    assert (
        prompt_ids + target_ids
        == chat(whole.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    )
    # turns after the last reply teach nothing and are left out
    longer = [*CONVERSATION, {"role": "user", "content": "bye"}]
    assert sft_example(longer, chat) == (prompt_ids, target_ids, mask)


def test_an_end_of_turn_token_other_than_eos_is_trained_on(chat: Any) -> None:
    """Qwen-style: replies end with ``<|im_end|>`` (a special token, not EOS) and a newline;
    the token is trained on, the newline is not."""
    from hf_testing.tiny import CHAT_TEMPLATE

    chat.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    chat.chat_template = CHAT_TEMPLATE.replace(
        "</tool_call>{% endfor %}<|endoftext|>", "</tool_call>{% endfor %}<|im_end|>"
    )
    _, target_ids, mask = sft_example(CONVERSATION, chat)
    trained = [text for on, text in _spans(chat, target_ids, mask) if on]
    assert trained[1:] == ["46.<|im_end|>", "2.<|im_end|>"]
    assert trained[0].endswith("</tool_call><|im_end|>")


def test_the_header_of_a_second_reply_in_a_row_is_not_trained_on(chat: Any) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "assistant", "content": "again"},
    ]
    _, target_ids, mask = sft_example(messages, chat)
    assert _spans(chat, target_ids, mask) == [
        (1, "hello<|endoftext|>"),
        (0, "\n<|im_start|>assistant\n"),
        (1, "again<|endoftext|>"),
    ]


def test_prompt_completion_without_a_template_is_sft_batch(plain: Any, tmp_path: Path) -> None:
    rows = [
        {"prompt": "12+34=", "completion": "46"},
        {"prompt": "reverse 1234567:", "completion": " 7654321"},
    ]
    prompt_ids, target_ids, mask = sft_example(
        [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}], plain
    )
    assert prompt_ids == plain("12+34=")["input_ids"]
    assert target_ids == [*plain("46", add_special_tokens=False)["input_ids"], plain.eos_token_id]
    assert mask == [1] * len(target_ids)

    dataset = SFTDataset.from_files(_jsonl(tmp_path / "sft.jsonl", rows), plain)
    batch = dataset.collate([0, 1])
    prompts = PromptDataset(
        [{"prompt": r["prompt"], "ground_truth": r["completion"]} for r in rows], plain
    ).collate([0, 1])
    expected = sft_batch(prompts, plain)
    assert sorted(batch.keys()) == sorted(expected.keys())
    for key in expected.keys():
        assert torch.equal(batch[key], expected[key]), key
    _check_layout(batch, plain.pad_token_id)


def test_prompt_completion_with_a_template(chat: Any) -> None:
    messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    prompt_ids, target_ids, mask = sft_example(messages, chat)
    assert chat.decode(prompt_ids) == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert _spans(chat, target_ids, mask) == [(1, "2<|endoftext|>")]


def test_a_template_that_is_not_prefix_stable_is_refused(chat: Any, tmp_path: Path) -> None:
    chat.chat_template = (
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}<{{ m.role }}>"
        "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    source = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1?", "completion": "2"}])
    with pytest.raises(DataError, match=r"sft\.jsonl: record 0 \(line 1\): .*not prefix-stable"):
        SFTDataset.from_files(source, chat)


def test_tokens_merging_across_a_turn_boundary_are_refused(chat: Any) -> None:
    chat.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "reve"}, {"role": "assistant", "content": "rse"}]
    with pytest.raises(DataError, match=r"row 7: .*tokenizes differently turn by turn"):
        sft_example(messages, chat, where="row 7")


def test_without_a_template_only_one_user_turn_and_one_reply(plain: Any) -> None:
    with pytest.raises(DataError, match="row 2: the tokenizer has no chat template"):
        sft_example(CONVERSATION, plain, where="row 2")
    with pytest.raises(DataError, match="no assistant turn"):
        sft_example([{"role": "user", "content": "hi"}], plain)


def test_preference_pairs_share_the_prompt_and_interleave(chat: Any, tmp_path: Path) -> None:
    hh = "\n\nHuman: What is 1+1?\n\nAssistant: 2.\n\nHuman: And 2+2?\n\nAssistant:"
    rows = [
        {"chosen": hh + " 4.", "rejected": hh + " Five, I think."},
        {"prompt": "reverse 12:", "chosen": "21", "rejected": "12"},
        {"prompt": "1+1?", "chosen": "2", "rejected": "2"},  # identical: dropped
    ]
    dataset = PreferenceDataset.from_files(_jsonl(tmp_path / "pairs.jsonl", rows), chat)
    assert len(dataset) == 2 and dict(dataset.dropped) == {"identical chosen and rejected": 1}
    first = dataset[0]
    assert chat.decode(first.prompt_ids) == (
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n2.<|endoftext|>\n"
        "<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _spans(chat, first.chosen_ids, first.chosen_mask) == [(1, "4.<|endoftext|>")]
    assert _spans(chat, first.rejected_ids, first.rejected_mask) == [
        (1, "Five, I think.<|endoftext|>")
    ]

    batch = dataset.collate([0, 1])
    assert batch["pair_side"].tolist() == [1, -1, 1, -1]
    assert batch["pair_index"].tolist() == [0, 0, 1, 1]
    _check_layout(batch, chat.pad_token_id)
    sides = [(example, side) for example in dataset.items for side in ("chosen", "rejected")]
    for row, (example, side) in enumerate(sides):
        ids = getattr(example, f"{side}_ids")
        real = batch["attention_mask"][row].bool()
        width = batch["prompts"].shape[1]
        assert batch["prompts"][row][real[:width]].tolist() == example.prompt_ids
        assert batch["responses"][row][real[width:]].tolist() == ids
        assert batch["response_mask"][row][: len(ids)].tolist() == getattr(example, f"{side}_mask")

    direct = preference_example(
        [{"role": "user", "content": "reverse 12:"}],
        [{"role": "assistant", "content": "21"}],
        [{"role": "assistant", "content": "12"}],
        chat,
    )
    second = dataset[1]
    assert direct == (
        second.prompt_ids,
        second.chosen_ids,
        second.chosen_mask,
        second.rejected_ids,
        second.rejected_mask,
    )


def test_rows_over_max_length_are_dropped_and_counted(chat: Any, tmp_path: Path) -> None:
    rows = [
        {"conversations": [{"from": "human", "value": "1+1?"}, {"from": "gpt", "value": "2"}]},
        {"prompt": "1+1? " * 40, "completion": "2"},
    ]
    source = _jsonl(tmp_path / "sft.jsonl", rows)
    dataset = SFTDataset.from_files(source, chat, max_length=32)
    assert len(dataset) == 1 and dataset[0].sample_index == 0
    assert dict(dataset.dropped) == {"longer than max_length=32 tokens": 1}
    with pytest.raises(DataError, match=r"no conversations left .*longer than max_length=4"):
        SFTDataset.from_files(source, chat, max_length=4)


def test_malformed_rows_are_refused_naming_file_and_row(chat: Any, tmp_path: Path) -> None:
    rows = [
        {"prompt": "1+1?", "completion": "2"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
    ]
    source = _jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.raises(DataError, match=r"sft\.jsonl: record 1 \(line 2\): messages\[1\]\.role"):
        SFTDataset.from_files(source, chat)
