"""hybridflow data prepare sft: chat messages / ShareGPT / prompt-completion / Alpaca rows ->
one ``messages`` record each, exactly; blank rows counted; malformed rows exit 2 naming the
file, row and field, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_core.cli import main
from hf_core.data.prepare import PrepareOptions, prepare
from hf_core.errors import DataError

TOOL_CALL = {
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "12+34"}'},
}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _prepare(tmp_path: Path, rows: list, *extra: str) -> tuple[int, Path]:
    source = _jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "out"
    code = main(["data", "prepare", "sft", "--input", str(source), "--output", str(out), *extra])
    return code, out


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    ("row", "messages"),
    [
        pytest.param(
            {
                "messages": [
                    {"role": "system", "content": "Be terse."},
                    _user("What is 12+34?"),
                    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                    {"role": "tool", "content": "46", "tool_call_id": "c1", "name": None},
                    _assistant("46."),
                ]
            },
            [
                {"role": "system", "content": "Be terse."},
                _user("What is 12+34?"),
                {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
                {"role": "tool", "content": "46", "tool_call_id": "c1"},
                _assistant("46."),
            ],
            id="messages-with-tools",
        ),
        pytest.param(
            {
                "conversations": [
                    {"from": "system", "value": "Be terse."},
                    {"from": "human", "value": "1+1?"},
                    {"from": "gpt", "value": "2"},
                    {"from": "human", "value": "and 2+2?"},
                    {"from": "gpt", "value": "4"},
                    {"from": "human", "value": "thanks"},  # after the last reply: cut
                ]
            },
            [
                {"role": "system", "content": "Be terse."},
                _user("1+1?"),
                _assistant("2"),
                _user("and 2+2?"),
                _assistant("4"),
            ],
            id="sharegpt",
        ),
        pytest.param(
            {"prompt": "1+1?", "completion": "2"},
            [_user("1+1?"), _assistant("2")],
            id="prompt-completion-strings",
        ),
        pytest.param(
            {"prompt": [_user("1+1?")], "completion": [_assistant("2")]},
            [_user("1+1?"), _assistant("2")],
            id="prompt-completion-messages",
        ),
        pytest.param(
            {"instruction": "Add the numbers.", "input": "1, 2", "output": "3"},
            [_user("Add the numbers.\n\n1, 2"), _assistant("3")],
            id="alpaca-with-input",
        ),
        pytest.param(
            {"instruction": "Say hi.", "input": "", "output": "hi"},
            [_user("Say hi."), _assistant("hi")],
            id="alpaca-empty-input",
        ),
    ],
)
def test_each_field_variant_converts(tmp_path: Path, row: dict, messages: list) -> None:
    code, out = _prepare(tmp_path, [row])
    assert code == 0
    assert _read(out / "train.jsonl") == [{"messages": messages, "source_row": 0}]


def test_blank_rows_are_dropped_and_counted(tmp_path: Path) -> None:
    rows = [
        {"prompt": "1+1?", "completion": "2"},
        {"prompt": "1+1?", "completion": "   "},
        {"instruction": " ", "output": "x"},
        {"messages": [_user("hi"), _assistant("")]},
    ]
    code, out = _prepare(tmp_path, rows, "--system", "You add.")
    assert code == 0
    assert _read(out / "train.jsonl") == [
        {
            "messages": [{"role": "system", "content": "You add."}, _user("1+1?"), _assistant("2")],
            "source_row": 0,
        }
    ]
    report = json.loads((out / "report.json").read_text())
    assert report["format"] == "sft" and report["template"] is None
    (output,) = report["outputs"]
    assert output["kept"] == 1 and output["dropped"] == 3
    assert output["dropped_by_reason"] == {"empty assistant reply": 2, "empty prompt": 1}
    assert "[assistant] 2" in (out / "preview.txt").read_text()


def test_tools_are_kept_and_preview_uses_the_chat_template(tmp_path: Path) -> None:
    from hf_testing.tiny import CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tok")
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    row = {"messages": [_user("1+1?"), _assistant("2")], "tools": tools}
    code, out = _prepare(tmp_path, [row], "--tokenizer", str(tmp_path / "tok"))
    assert code == 0
    assert _read(out / "train.jsonl")[0]["tools"] == tools
    preview = (out / "preview.txt").read_text()
    assert "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n" in preview
    assert "2<|endoftext|>" in preview


def test_parquet_messages_lose_the_null_keys_of_the_struct(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"messages": [_user("1+1?"), _assistant("2")]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    reports = prepare(PrepareOptions("sft", [tmp_path / "train.parquet"], tmp_path / "out"))
    assert reports[0].kept == 1
    assert _read(tmp_path / "out" / "train.jsonl")[0]["messages"] == rows[0]["messages"]


@pytest.mark.parametrize(
    ("row", "what"),
    [
        ({"messages": [_user("hi")]}, "'messages': no assistant turn"),
        ({"messages": [_user("hi"), {"role": "bot", "content": "x"}]}, "messages[1].role"),
        ({"messages": [_user("hi"), _assistant(["x"])]}, "messages[1].content must be a string"),
        ({"messages": [_assistant("hi")]}, "messages[0].role: the conversation starts"),
        ({"messages": "hi"}, "'messages' must be a list"),
        ({"conversations": [{"from": "robot", "value": "x"}]}, "conversations[0].from"),
        ({"conversations": [{"from": "human", "value": 3}]}, "conversations[0].value"),
        ({"prompt": "hi", "completion": [_user("x")]}, "completion[0].role"),
        ({"instruction": "hi", "output": None}, "'output' must be a string"),
        ({"question": "hi", "answer": "x"}, "no conversation"),
    ],
)
def test_malformed_rows_exit_2_naming_file_row_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], row: dict, what: str
) -> None:
    code, out = _prepare(tmp_path, [{"prompt": "ok", "completion": "fine"}, row])
    assert code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'train.jsonl'}: row 1 (line 2)" in message and what in message
    assert not out.exists()  # nothing written when an input is malformed


def test_a_template_is_refused(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match="takes no prompt template"):
        prepare(PrepareOptions("sft", [source], tmp_path / "o", template="{question}"))
