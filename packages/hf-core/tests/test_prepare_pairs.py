"""hybridflow data prepare preference: prompt/chosen/rejected (strings or messages, replies with
or without the prompt), whole conversations and Anthropic HH transcripts -> one pair record
each, exactly; identical and blank pairs counted; malformed rows exit 2 with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_core.cli import main
from hf_core.data.prepare import PrepareOptions, prepare
from hf_core.data.prepare_pairs import hh_messages, split_shared_prefix
from hf_core.errors import DataError

HH_PROMPT = "\n\nHuman: What is 1+1?\n\nAssistant: 2.\n\nHuman: And 2+2?"


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _prepare(tmp_path: Path, rows: list, *extra: str) -> tuple[int, Path]:
    source = _jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    argv = ["data", "prepare", "preference", "--input", str(source), "--output", str(out)]
    return main([*argv, *extra]), out


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_hh_transcripts_split_into_turns() -> None:
    assert hh_messages(HH_PROMPT + "\n\nAssistant: 4.", "f: row 0", "chosen") == [
        _user("What is 1+1?"),
        _assistant("2."),
        _user("And 2+2?"),
        _assistant("4."),
    ]
    # a transcript without the leading blank line reads the same
    assert hh_messages("Human: hi\n\nAssistant: hello", "f: row 0", "chosen") == [
        _user("hi"),
        _assistant("hello"),
    ]
    with pytest.raises(DataError, match="f: row 3: 'rejected' is not an Anthropic HH"):
        hh_messages("just an answer", "f: row 3", "rejected")


def test_the_shared_prefix_is_the_prompt() -> None:
    chosen = [_user("a"), _assistant("b"), _user("c"), _assistant("good")]
    rejected = [_user("a"), _assistant("b"), _user("c"), _assistant("bad"), _user("more")]
    assert split_shared_prefix(chosen, rejected) == (
        chosen[:3],
        [_assistant("good")],
        [_assistant("bad"), _user("more")],
    )
    assert split_shared_prefix(chosen, list(chosen)) == "identical chosen and rejected"
    assert split_shared_prefix(chosen, chosen[:3]) == "empty rejected"
    other = [_user("a"), _assistant("b"), _user("x"), _assistant("good")]
    assert "part at a turn other than the assistant's" in str(split_shared_prefix(chosen, other))


@pytest.mark.parametrize(
    ("row", "pair"),
    [
        pytest.param(
            {"prompt": "1+1?", "chosen": "2", "rejected": "3"},
            ([_user("1+1?")], [_assistant("2")], [_assistant("3")]),
            id="strings",
        ),
        pytest.param(
            {  # UltraFeedback-binarized: replies are whole conversations with the prompt
                "prompt": "1+1?",
                "chosen": [_user("1+1?"), _assistant("2")],
                "rejected": [_user("1+1?"), _assistant("3")],
                "score_chosen": 9.0,
            },
            ([_user("1+1?")], [_assistant("2")], [_assistant("3")]),
            id="ultrafeedback",
        ),
        pytest.param(
            {
                "prompt": [{"role": "system", "content": "Add."}, _user("1+1?")],
                "chosen": [_assistant("2")],
                "rejected": [_assistant("3")],
            },
            (
                [{"role": "system", "content": "Add."}, _user("1+1?")],
                [_assistant("2")],
                [_assistant("3")],
            ),
            id="trl-conversational",
        ),
        pytest.param(
            {
                "chosen": [_user("1+1?"), _assistant("2"), _user("2+2?"), _assistant("4")],
                "rejected": [_user("1+1?"), _assistant("2"), _user("2+2?"), _assistant("5")],
            },
            (
                [_user("1+1?"), _assistant("2"), _user("2+2?")],
                [_assistant("4")],
                [_assistant("5")],
            ),
            id="whole-conversations",
        ),
        pytest.param(
            {
                "chosen": HH_PROMPT + "\n\nAssistant: 4.",
                "rejected": HH_PROMPT + "\n\nAssistant: Five.",
            },
            (
                [_user("What is 1+1?"), _assistant("2."), _user("And 2+2?")],
                [_assistant("4.")],
                [_assistant("Five.")],
            ),
            id="anthropic-hh",
        ),
        pytest.param(
            {"prompt": HH_PROMPT + "\n\nAssistant:", "chosen": " 4.", "rejected": " Five."},
            (
                [_user("What is 1+1?"), _assistant("2."), _user("And 2+2?")],
                [_assistant("4.")],
                [_assistant("Five.")],
            ),
            id="hh-prompt-column",
        ),
        pytest.param(
            {"question": "1+1?", "response_chosen": "2", "response_rejected": "3"},
            ([_user("1+1?")], [_assistant("2")], [_assistant("3")]),
            id="question-responses",
        ),
    ],
)
def test_each_field_variant_converts(tmp_path: Path, row: dict, pair: tuple) -> None:
    code, out = _prepare(tmp_path, [row])
    assert code == 0
    prompt, chosen, rejected = pair
    assert _read(out / "pairs.jsonl") == [
        {"prompt": prompt, "chosen": chosen, "rejected": rejected, "source_row": 0}
    ]


def test_identical_and_blank_pairs_are_dropped_and_counted(tmp_path: Path) -> None:
    rows = [
        {"prompt": "1+1?", "chosen": "2", "rejected": "3"},
        {"prompt": "1+1?", "chosen": "2", "rejected": " 2 "},
        {"prompt": "1+1?", "chosen": "", "rejected": "3"},
        {"prompt": "1+1?", "chosen": "2", "rejected": []},
        {"prompt": " ", "chosen": "2", "rejected": "3"},
        {"chosen": HH_PROMPT + "\n\nAssistant: 4.", "rejected": HH_PROMPT + "\n\nAssistant: 4."},
        {"chosen": HH_PROMPT + "\n\nAssistant: 4.", "rejected": HH_PROMPT + "\n\nAssistant:"},
        {"prompt": "1+1?", "chosen": [_user("2+2?"), _assistant("4")], "rejected": "3"},
    ]
    code, out = _prepare(tmp_path, rows, "--system", "You add.")
    assert code == 0
    assert _read(out / "pairs.jsonl") == [
        {
            "prompt": [{"role": "system", "content": "You add."}, _user("1+1?")],
            "chosen": [_assistant("2")],
            "rejected": [_assistant("3")],
            "source_row": 0,
        }
    ]
    (output,) = json.loads((out / "report.json").read_text())["outputs"]
    assert output["dropped_by_reason"] == {
        "chosen does not continue the prompt": 1,
        "empty chosen": 1,
        "empty prompt": 1,
        "empty rejected": 2,
        "identical chosen and rejected": 2,
    }
    preview = (out / "preview.txt").read_text()
    assert "--- chosen ---\n[assistant] 2\n--- rejected ---\n[assistant] 3" in preview


@pytest.mark.parametrize(
    ("row", "what"),
    [
        ({"chosen": "2", "rejected": "3"}, "'chosen' is not an Anthropic HH transcript"),
        ({"chosen": [_user("a"), _assistant("b")], "rejected": "x"}, "must both be HH"),
        ({"prompt": "a", "chosen": "b"}, "no preference pair"),
        (
            {"prompt": "a", "chosen": [{"role": "bot", "content": "b"}], "rejected": "c"},
            "chosen[0].role",
        ),
        ({"prompt": "a", "chosen": "b", "rejected": [_assistant(None)]}, "rejected[0].content"),
        ({"prompt": 3, "chosen": "b", "rejected": "c"}, "'prompt' must be a list of messages"),
        ({"response_chosen": "b", "response_rejected": "c"}, "no 'question' field"),
    ],
)
def test_malformed_rows_exit_2_naming_file_row_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], row: dict, what: str
) -> None:
    code, out = _prepare(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c"}, row])
    assert code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'pairs.jsonl'}: row 1 (line 2)" in message and what in message
    assert not out.exists()  # nothing written when an input is malformed


def test_no_usable_pairs_is_an_error(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "b"}])
    with pytest.raises(DataError, match=r"no usable rows .*identical chosen and rejected"):
        prepare(PrepareOptions("preference", [source], tmp_path / "o"))
    assert not (tmp_path / "o").exists()
