"""hf_core.data: reading prompt files, tokenising, left padding, filtering, resumable loading."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from hf_core.data import (
    DataError,
    PromptDataset,
    PromptLoader,
    check_dataset_file,
    read_records,
    write_jsonl,
)

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny byte-level BPE tokenizer (no hub needed) with a BOS it adds and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["reverse 12345: 54321", "sort 3141: 1134", "user assistant system hello"] * 20
    tok.train_from_iterator(
        corpus,
        BpeTrainer(
            vocab_size=300,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


@pytest.fixture(scope="module")
def raw_tokenizer(tokenizer):
    """The same tokenizer without a chat template."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    return tok


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _digit_file(path: Path, n: int) -> Path:
    # Prompts of different lengths so left padding shows up.
    rows = [
        {"prompt": f"reverse {'7' * (1 + i % 5)}{i}:", "ground_truth": str(i)} for i in range(n)
    ]
    return write_jsonl(rows, path)


# ------------------------------------------------------------------------------ reading


def test_jsonl_to_left_padded_batch(tmp_path, raw_tokenizer):
    path = _write_lines(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "reverse 12:", "ground_truth": "21", "source": "a"}),
            "",  # blank lines are skipped
            json.dumps({"prompt": "reverse 12345:", "ground_truth": "54321", "level": 3}),
            json.dumps({"prompt": "sort 31:"}),
        ],
    )
    ds = PromptDataset.from_files(path, raw_tokenizer)
    assert ds.chat_template is False and len(ds) == 3 and ds.num_filtered == 0
    batch = ds.collate([0, 1, 2])

    expected = [
        raw_tokenizer(p)["input_ids"] for p in ("reverse 12:", "reverse 12345:", "sort 31:")
    ]
    assert all(ids[0] == raw_tokenizer.bos_token_id for ids in expected)
    width = max(map(len, expected))
    assert batch["input_ids"].shape == (3, width)
    assert batch["input_ids"].dtype == torch.long
    for row, ids in enumerate(expected):
        pad = width - len(ids)
        assert batch["input_ids"][row, pad:].tolist() == ids
        assert batch["input_ids"][row, :pad].tolist() == [raw_tokenizer.pad_token_id] * pad
        assert batch["attention_mask"][row].tolist() == [0] * pad + [1] * len(ids)
        assert batch["position_ids"][row].tolist() == [0] * pad + list(range(len(ids)))
    assert list(batch["raw_prompt"]) == ["reverse 12:", "reverse 12345:", "sort 31:"]
    assert list(batch["ground_truth"]) == ["21", "54321", None]
    assert list(batch["sample_index"]) == [0, 1, 2]
    assert list(batch["source"]) == ["a", None, None]
    assert list(batch["level"]) == [None, 3, None]


def test_chat_template_for_strings_and_messages(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "sort 31:"}]
    path = write_jsonl(
        [{"prompt": "reverse 12:"}, {"prompt": messages, "ground_truth": "13"}],
        tmp_path / "c.jsonl",
    )
    ds = PromptDataset.from_files(path, tokenizer)
    assert ds.chat_template is True
    rendered = [
        "<s>user: reverse 12:|assistant:",
        "<s>system: be terse|<s>user: sort 31:|assistant:",
    ]
    for item, text in zip(ds.items, rendered, strict=True):
        # The template carries the BOS: no second one is added.
        assert item.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ds.items[1].input_ids) == rendered[1]
    batch = ds.collate([1])
    assert batch["raw_prompt"][0] == messages


def test_messages_without_chat_template_is_an_error(tmp_path, raw_tokenizer):
    path = write_jsonl([{"prompt": [{"role": "user", "content": "x"}]}], tmp_path / "m.jsonl")
    with pytest.raises(DataError, match=r"m\.jsonl: record 0 \(line 1\).*chat template"):
        PromptDataset.from_files(path, raw_tokenizer)
    with pytest.raises(DataError, match="no chat template"):
        PromptDataset.from_files(path, raw_tokenizer, chat_template=True)


def test_parquet_with_nested_ground_truth(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.Table.from_pylist(
        [
            {
                "prompt": [{"role": "user", "content": "reverse 12:"}],
                "reward_model": {"ground_truth": "21", "style": "rule"},
                "data_source": "digits",
            },
            {
                "prompt": [{"role": "user", "content": "reverse 345:"}],
                "reward_model": {"ground_truth": "543", "style": "rule"},
                "data_source": "digits",
            },
        ]
    )
    pq.write_table(table, tmp_path / "train.parquet")
    ds = PromptDataset.from_files(
        tmp_path / "train.parquet", tokenizer, ground_truth_key="reward_model.ground_truth"
    )
    batch = ds.collate([0, 1])
    assert list(batch["ground_truth"]) == ["21", "543"]
    assert list(batch["data_source"]) == ["digits", "digits"]
    assert batch["raw_prompt"][1] == [{"role": "user", "content": "reverse 345:"}]
    assert (
        ds.items[1].input_ids
        == tokenizer("<s>user: reverse 345:|assistant:", add_special_tokens=False)["input_ids"]
    )


def test_several_files_concatenate(tmp_path, raw_tokenizer):
    a = write_jsonl([{"prompt": "a"}, {"prompt": "b"}], tmp_path / "a.jsonl")
    b = write_jsonl([{"prompt": "c"}], tmp_path / "b.json")
    ds = PromptDataset.from_files([a, b], raw_tokenizer)
    assert [item.raw_prompt for item in ds.items] == ["a", "b", "c"]
    assert [item.sample_index for item in ds.items] == [0, 1, 2]
    (tmp_path / "arr.json").write_text(json.dumps([{"prompt": "x"}, {"prompt": "y"}]))
    assert [r["prompt"] for r, _ in read_records(tmp_path / "arr.json")] == ["x", "y"]


def test_over_long_prompts_are_dropped_and_logged(tmp_path, raw_tokenizer, caplog):
    prompts = ["reverse 1:", "reverse 12345 12345 12345 12345:", "sort 2:", "x " * 40]
    path = write_jsonl([{"prompt": p} for p in prompts], tmp_path / "long.jsonl")
    limit = max(len(raw_tokenizer(p)["input_ids"]) for p in ("reverse 1:", "sort 2:"))
    assert len(raw_tokenizer(prompts[1])["input_ids"]) > limit
    with caplog.at_level(logging.WARNING, logger="hf_core.data"):
        ds = PromptDataset.from_files(path, raw_tokenizer, max_prompt_length=limit)
    assert len(ds) == 2 and ds.num_filtered == 2 and ds.num_records == 4
    assert [item.raw_prompt for item in ds.items] == ["reverse 1:", "sort 2:"]
    assert [item.sample_index for item in ds.items] == [0, 2]
    assert "dropped 2 of 4 prompts" in caplog.text
    assert f"max_prompt_length={limit}" in caplog.text
    with pytest.raises(DataError, match=r"no prompts left.*all 4 exceed"):
        PromptDataset.from_files(path, raw_tokenizer, max_prompt_length=1)


# ------------------------------------------------------------------------------ errors


def test_missing_file_names_the_path(tmp_path, raw_tokenizer):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope/train\.jsonl"):
        PromptDataset.from_files(missing, raw_tokenizer)


def test_malformed_jsonl_names_file_and_line(tmp_path, raw_tokenizer):
    path = _write_lines(
        tmp_path / "bad.jsonl",
        [json.dumps({"prompt": "a"}), json.dumps({"prompt": "b"}), '{"prompt": "c",', "{}"],
    )
    with pytest.raises(DataError, match=r"bad\.jsonl: line 3: malformed JSON \(.* column 16\)"):
        PromptDataset.from_files(path, raw_tokenizer)  # the column within that line
    path = _write_lines(tmp_path / "list.jsonl", [json.dumps({"prompt": "a"}), "[1, 2]"])
    with pytest.raises(DataError, match=r"list\.jsonl: line 2: expected a JSON object, got list"):
        read_records(path)


def test_missing_prompt_key_names_key_file_and_record(tmp_path, raw_tokenizer):
    path = _write_lines(
        tmp_path / "keys.jsonl",
        [json.dumps({"question": "a"}), "", json.dumps({"q": "b", "answer": 1})],
    )
    with pytest.raises(DataError) as info:
        PromptDataset.from_files(path, raw_tokenizer, prompt_key="question")
    message = str(info.value)
    assert f"{path}: record 1 (line 3)" in message
    assert "missing prompt key 'question'" in message and "['answer', 'q']" in message


def test_bad_prompt_type_unsupported_suffix_and_reserved_keys(tmp_path, raw_tokenizer):
    path = write_jsonl([{"prompt": "ok"}, {"prompt": 42}], tmp_path / "t.jsonl")
    with pytest.raises(DataError, match=r"record 1 \(line 2\).*got int"):
        PromptDataset.from_files(path, raw_tokenizer)
    (tmp_path / "t.csv").write_text("prompt\nx\n")
    with pytest.raises(DataError, match=r"t\.csv: unsupported file type '\.csv'"):
        PromptDataset.from_files(tmp_path / "t.csv", raw_tokenizer)
    path = write_jsonl([{"prompt": "x", "input_ids": [1]}], tmp_path / "r.jsonl")
    with pytest.raises(DataError, match=r"\['input_ids'\] clash"):
        PromptDataset.from_files(path, raw_tokenizer)


def test_write_jsonl_is_all_or_nothing(tmp_path):
    path = write_jsonl([{"prompt": "a"}], tmp_path / "d.jsonl")
    before = path.read_bytes()
    with pytest.raises(DataError, match="record 1 is not JSON-serialisable"):
        write_jsonl([{"prompt": "b"}, {"prompt": object()}], path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


# ------------------------------------------------------------------------------ loader


def _indices(batch) -> list[int]:
    return [int(i) for i in batch["sample_index"]]


def test_loader_epochs_shuffle_and_drop_last(tmp_path, raw_tokenizer):
    ds = PromptDataset.from_files(_digit_file(tmp_path / "d.jsonl", 10), raw_tokenizer)
    loader = PromptLoader(ds, 4, shuffle=True, seed=3, drop_last=True, num_epochs=2)
    assert len(loader) == 2 and loader.total_batches == 4
    batches = [_indices(b) for b in loader]
    assert len(batches) == 4 and all(len(b) == 4 for b in batches)
    epoch0, epoch1 = batches[0] + batches[1], batches[2] + batches[3]
    assert len(set(epoch0)) == 8 and len(set(epoch1)) == 8  # no repeats inside an epoch
    assert epoch0 != epoch1  # reshuffled per epoch
    assert list(loader) == []  # exhausted
    again = [_indices(b) for b in PromptLoader(ds, 4, seed=3, num_epochs=2)]
    assert again == batches
    other = [_indices(b) for b in PromptLoader(ds, 4, seed=4, num_epochs=2)]
    assert other != batches

    keep = PromptLoader(ds, 4, shuffle=False, drop_last=False, num_epochs=2)
    assert len(keep) == 3
    assert [_indices(b) for b in keep] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] * 2
    with pytest.raises(DataError, match="cannot fill one batch of 11"):
        PromptLoader(ds, 11)


def test_loader_resumes_exactly(tmp_path, raw_tokenizer):
    path = _digit_file(tmp_path / "d.jsonl", 11)
    ds = PromptDataset.from_files(path, raw_tokenizer)
    reference = PromptLoader(ds, 3, seed=7, num_epochs=3)
    full = list(reference)
    assert len(full) == 9  # 3 full batches per epoch, 2 prompts dropped each epoch

    for k in (2, 3, 4, 8):  # inside an epoch, at the boundary, after it, near the end
        first = PromptLoader(ds, 3, seed=7, num_epochs=3)
        for _ in range(k):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))  # must survive a checkpoint
        # A new process: dataset re-read from disk, a new loader.
        resumed = PromptLoader(
            PromptDataset.from_files(path, raw_tokenizer), 3, seed=7, num_epochs=3
        )
        resumed.load_state_dict(state)
        assert resumed.batches_done == k
        rest = list(resumed)
        assert len(rest) == 9 - k
        for got, want in zip(rest, full[k:], strict=True):
            assert torch.equal(got["input_ids"], want["input_ids"])
            assert torch.equal(got["attention_mask"], want["attention_mask"])
            assert _indices(got) == _indices(want)
            assert list(got["ground_truth"]) == list(want["ground_truth"])


def test_loader_refuses_a_mismatched_state(tmp_path, raw_tokenizer):
    ds = PromptDataset.from_files(_digit_file(tmp_path / "d.jsonl", 8), raw_tokenizer)
    loader = PromptLoader(ds, 2, seed=1)
    next(loader)
    state = loader.state_dict()
    with pytest.raises(DataError, match="seed: saved 1, now 2"):
        PromptLoader(ds, 2, seed=2).load_state_dict(state)
    smaller = PromptDataset.from_files(_digit_file(tmp_path / "e.jsonl", 6), raw_tokenizer)
    with pytest.raises(DataError, match="num_samples: saved 8, now 6"):
        PromptLoader(smaller, 2, seed=1).load_state_dict(state)
    other = PromptDataset.from_files(
        write_jsonl([{"prompt": f"sort {i}:"} for i in range(8)], tmp_path / "f.jsonl"),
        raw_tokenizer,
    )
    with pytest.raises(DataError, match="dataset_fingerprint"):
        PromptLoader(other, 2, seed=1).load_state_dict(state)
    lenient = PromptLoader(ds, 2, seed=2)
    lenient.load_state_dict(state, strict=False)
    assert lenient.state_dict()["offset"] == 2


def test_validation_loader_is_a_single_ordered_pass(tmp_path, raw_tokenizer):
    ds = PromptDataset.from_files(_digit_file(tmp_path / "v.jsonl", 5), raw_tokenizer)
    val = PromptLoader.for_validation(ds, 2)
    first = [_indices(b) for b in val]
    assert first == [[0, 1], [2, 3], [4]]
    assert [_indices(b) for b in val] == first  # every evaluation sees the whole set again


def test_check_dataset_file_names_the_key(tmp_path: Path) -> None:
    """The cheap checks a run makes before it starts (no records are read)."""
    key = "data.train_files[0]"
    with pytest.raises(DataError, match=r"data\.train_files\[0\]: prompt dataset .* does not"):
        check_dataset_file(tmp_path / "nowhere.jsonl", key=key)
    with pytest.raises(DataError, match="is not a file"):
        check_dataset_file(tmp_path, key=key)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
        check_dataset_file(empty, key=key)
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.csv'"):
        check_dataset_file(csv, key=key)
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "x"}\n')
    check_dataset_file(good, key=key)
