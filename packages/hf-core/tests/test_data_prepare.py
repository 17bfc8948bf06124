"""hybridflow data prepare: GSM8K / MATH / saved-datasets / JSONL-Parquet rows written by the
tests -> prompt / ground-truth JSONL, exactly; dropped rows counted; malformed rows exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_core.cli import main
from hf_core.data import PromptDataset
from hf_core.data.answers import gsm8k_final_answer, last_boxed
from hf_core.data.prepare import DEFAULT_TEMPLATES, PrepareOptions, prepare
from hf_core.errors import DataError

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 friends in April, and half as many in May. "
        "How many clips did she sell altogether?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n"
        "Altogether 48+24 = <<48+24=72>>72 clips.\n#### 72",
    },
    {"question": "A farm has 1,200 hens and buys 34 more. How many?", "answer": "#### 1,234"},
    {"question": "What is 5 - 7?", "answer": "5 - 7 = -2\n#### -2"},
    {"question": "Missing the mark", "answer": "the answer is 5"},  # dropped: no ####
    {"question": "   ", "answer": "#### 3"},  # dropped: empty question
]
GSM8K_SUFFIX = DEFAULT_TEMPLATES["gsm8k"].replace("{question}", "")

MATH_ROWS = [
    {
        "problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?",
        "solution": "Adding, $\\frac{1}{4}+\\frac{1}{4} = \\boxed{\\frac{1}{2}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {
        "problem": "Simplify $\\sqrt{8}$.",
        "solution": "First $\\boxed{4}$ is wrong; $\\sqrt{8} = \\boxed{2\\sqrt{2}}$.",
        "level": "Level 2",
        "type": "Algebra",
    },
    {"problem": "No box here.", "solution": "The answer is 3.", "level": "Level 1", "type": "X"},
]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_final_answer_extraction() -> None:
    assert gsm8k_final_answer("x\n#### 1,234") == "1234"
    assert gsm8k_final_answer("#### 1\n#### 2 ") == "2"
    assert gsm8k_final_answer("no mark") is None
    assert gsm8k_final_answer("####   ") is None
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("\\boxed{ }") is None
    assert last_boxed("nothing") is None


def test_gsm8k_conversion_is_exact(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    out = tmp_path / "out"
    assert main(["data", "prepare", "gsm8k", "--input", str(source), "--output", str(out)]) == 0
    template = DEFAULT_TEMPLATES["gsm8k"]
    assert _read(out / "train.jsonl") == [
        {
            "prompt": template.replace("{question}", GSM8K_ROWS[i]["question"].strip()),
            "ground_truth": truth,
            "data_source": "gsm8k",
            "source_row": i,
        }
        for i, truth in [(0, "72"), (1, "1234"), (2, "-2")]
    ]
    report = json.loads((out / "report.json").read_text())["outputs"][0]
    assert (report["kept"], report["dropped"]) == (3, 2)
    assert report["dropped_by_reason"] == {
        "empty question": 1,
        "no final answer after '####' in answer": 1,
    }
    assert [r["row"] for r in report["dropped_rows"]] == [
        f"{source}: row 3 (line 4)",
        f"{source}: row 4 (line 5)",
    ]
    preview = (out / "preview.txt").read_text()
    assert GSM8K_ROWS[0]["question"] in preview and "--- ground truth: 72" in preview


def test_math_folder_and_jsonl_are_exact(tmp_path: Path) -> None:
    folder = tmp_path / "MATH" / "test"
    for i, row in enumerate(MATH_ROWS):
        sub = folder / row["type"].lower()
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{i}.json").write_text(json.dumps(row))
    flat = _jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    out = tmp_path / "out"
    system = "You are a careful mathematician."
    reports = prepare(
        PrepareOptions("math", [folder, flat], out, system=system, template="Q: {question}")
    )
    assert [(r.kept, sum(r.dropped.values())) for r in reports] == [(2, 1), (2, 1)]
    expected = [
        {
            "prompt": [
                {"role": "system", "content": system},
                {"role": "user", "content": "Q: " + MATH_ROWS[i]["problem"]},
            ],
            "ground_truth": truth,
            "data_source": "math",
            "level": MATH_ROWS[i]["level"],
            "type": MATH_ROWS[i]["type"],
        }
        for i, truth in [(0, "\\frac{1}{2}"), (1, "2\\sqrt{2}")]
    ]
    flat_rows = _read(out / "math.jsonl")
    assert [{k: v for k, v in r.items() if k != "source_row"} for r in flat_rows] == expected
    assert [r["source_row"] for r in flat_rows] == [0, 1]
    folder_rows = _read(out / "test.jsonl")  # sorted paths: algebra/1, prealgebra/0, x/2
    assert [r["ground_truth"] for r in folder_rows] == ["2\\sqrt{2}", "\\frac{1}{2}"]
    assert reports[0].dropped == {"no \\boxed{...} answer in solution": 1}
    # one problem file given alone (MATH's files are single, multi-line JSON objects)
    single = tmp_path / "one.json"
    single.write_text(json.dumps(MATH_ROWS[1], indent=2))
    prepare(PrepareOptions("math", [single], out))
    assert [r["ground_truth"] for r in _read(out / "one.jsonl")] == ["2\\sqrt{2}"]


def test_jsonl_and_parquet_named_columns(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"q": "2+2?", "a": 4}, {"q": "Half of 1?", "a": "0.5"}, {"q": "x", "a": ""}]
    parquet_rows = [{"q": "2+2?", "a": 4.0}, {"q": "Half of 1?", "a": 0.5}]
    pq.write_table(pa.Table.from_pylist(parquet_rows), tmp_path / "p.parquet")
    _jsonl(tmp_path / "j.jsonl", rows)
    args = ["--prompt-key", "q", "--answer-key", "a", "--template", "Solve: {question}"]
    out = tmp_path / "out"
    code = main(
        [
            "data",
            "prepare",
            "jsonl",
            "--input",
            str(tmp_path / "j.jsonl"),
            "--output",
            str(out),
            *args,
        ]
    )
    assert code == 0
    assert [(r["prompt"], r["ground_truth"]) for r in _read(out / "j.jsonl")] == [
        ("Solve: 2+2?", "4"),
        ("Solve: Half of 1?", "0.5"),
    ]
    code = main(
        [
            "data",
            "prepare",
            "jsonl",
            "--input",
            str(tmp_path / "p.parquet"),
            "--output",
            str(out),
            *args,
        ]
    )
    assert code == 0
    assert [r["ground_truth"] for r in _read(out / "p.jsonl")] == ["4.0", "0.5"]


def test_saved_datasets_dataset_per_split(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "gsm8k_saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(GSM8K_ROWS[:2]),
            "test": datasets.Dataset.from_list(GSM8K_ROWS[2:4]),
        }
    ).save_to_disk(str(saved))
    out = tmp_path / "out"
    reports = prepare(PrepareOptions("datasets", [saved], out, extract="gsm8k"))
    assert sorted(Path(r.output).name for r in reports) == ["test.jsonl", "train.jsonl"]
    assert [r["ground_truth"] for r in _read(out / "train.jsonl")] == ["72", "1234"]
    assert [r["prompt"] for r in _read(out / "test.jsonl")] == [GSM8K_ROWS[2]["question"]]


def test_the_retired_hf_format_is_refused_naming_datasets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hf`` means HybridFlow: the saved-``datasets`` format is ``datasets`` (issue 58)."""
    with pytest.raises(DataError, match="format 'hf' was renamed 'datasets'"):
        PrepareOptions("hf", [tmp_path], tmp_path / "out")  # type: ignore[arg-type]
    with pytest.raises(SystemExit) as exited:
        main(["data", "prepare", "hf", "--input", str(tmp_path), "--output", str(tmp_path)])
    assert exited.value.code == 2
    assert "format 'hf' was renamed 'datasets'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("lines", "where", "what"),
    [
        (['{"question": "ok", "answer": "#### 1"}', '{"question": "cut'], "line 2", "JSON"),
        (['{"question": "ok", "answer": "#### 1"}', "[1, 2]"], "line 2", "JSON object"),
        (
            ['{"question": "ok", "answer": "#### 1"}', '{"problem": "x", "answer": "#### 2"}'],
            "row 1 (line 2)",
            "no 'question' field",
        ),
        (['{"question": ["a"], "answer": "#### 1"}'], "row 0 (line 1)", "must be a string"),
    ],
)
def test_malformed_rows_exit_2_naming_file_and_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], where: str, what: str
) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["data", "prepare", "gsm8k", "--input", str(source), "--output", str(out)]) == 2
    message = " ".join(capsys.readouterr().err.split())
    assert f"{source}: {where}" in message and what in message
    assert not out.exists()  # nothing written when an input is malformed


def test_bad_options_are_data_errors(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "t.jsonl", GSM8K_ROWS)
    with pytest.raises(DataError, match="must contain '\\{question\\}'"):
        prepare(PrepareOptions("gsm8k", [source], tmp_path / "o", template="no placeholder"))
    with pytest.raises(DataError, match="does not exist"):
        prepare(PrepareOptions("gsm8k", [tmp_path / "missing.jsonl"], tmp_path / "o"))
    empty = _jsonl(tmp_path / "e.jsonl", GSM8K_ROWS[3:])
    with pytest.raises(DataError, match="no usable rows"):
        prepare(PrepareOptions("gsm8k", [empty], tmp_path / "o"))


def test_output_is_what_the_trainer_dataset_reads(tmp_path: Path) -> None:
    from hf_testing.tiny import build_tokenizer

    source = _jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    prepare(PrepareOptions("gsm8k", [source], tmp_path / "out"))
    dataset = PromptDataset.from_files(str(tmp_path / "out" / "train.jsonl"), build_tokenizer())
    batch = dataset.collate([0, 1, 2])
    assert list(batch["ground_truth"]) == ["72", "1234", "-2"]
    assert list(batch["data_source"]) == ["gsm8k"] * 3
    assert batch["raw_prompt"][0].endswith(GSM8K_SUFFIX)
