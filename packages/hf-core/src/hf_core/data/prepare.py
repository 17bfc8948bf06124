"""Public dataset formats -> the prompt / ground-truth (or conversation) JSONL files a recipe
reads.

    report = prepare(PrepareOptions("gsm8k", [Path("gsm8k/train.jsonl")], Path("data/gsm8k")))

Formats (``fmt``):

* ``gsm8k``: records with ``question`` and ``answer``; the ground truth is what follows the last
  ``####`` of the answer, thousands separators removed (``"#### 1,234"`` -> ``"1234"``).
* ``math``: records with ``problem`` and ``solution`` (the MATH benchmark; an input folder is
  read as one JSON object per ``*.json`` file under it, in sorted path order); the ground truth
  is the content of the solution's last ``\\boxed{...}`` (or ``\\fbox{...}``).  ``level`` and
  ``type`` are kept.
* ``vlm``: image + question + answer rows (geometry3k-style JSONL / JSON / Parquet): named
  columns as for ``jsonl`` plus ``image_key`` (one image or a
  list); each image is decoded and checked, written under ``<output>/images/`` and listed in
  the record's ``images`` (:mod:`hf_core.data.prepare_images`).  The question marks each
  image with ``<image>``.
* ``datasets``: a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (a
  ``DatasetDict`` gives one output per split; the format was called ``hf`` before ``hf`` came to
  mean HybridFlow alone, and that spelling is refused naming this one); ``jsonl``: JSONL / JSON /
  Parquet files.  Both take named columns
  (``prompt_key`` / ``answer_key``) and an ``extract`` rule for the answer (``none``, ``gsm8k``,
  ``boxed``).
* ``sft``: conversations for supervised fine-tuning -- chat ``messages``, ShareGPT
  ``conversations``, ``prompt`` + ``completion`` or Alpaca ``instruction`` / ``input`` /
  ``output`` -- as ``{"messages": [...], "source_row": i}`` (:mod:`hf_core.data.prepare_sft`).
* ``preference``: pairs for a reward model or DPO -- ``prompt`` / ``chosen`` / ``rejected``
  (strings or messages, replies with or without the prompt), whole conversations, Anthropic
  HH transcripts -- as ``{"prompt": [...], "chosen": [...], "rejected": [...], "source_row":
  i}`` (:mod:`hf_core.data.prepare_pairs`).  These two take no template (``--system`` adds a
  system turn where a conversation has none).

Each input becomes ``<output>/<name>.jsonl`` (``name``: the file's stem, the folder's name, or
the split) with one record per kept row (those of ``sft`` and ``preference`` are above)::

    {"prompt": "<template with the question>", "ground_truth": "72",
     "data_source": "gsm8k", "source_row": 0}

``prompt`` is a string (the dataset applies the tokenizer's chat template when training), or a
chat ``messages`` list when a system prompt is given.  Rows that parse but cannot be used
(empty question, no final answer) are dropped and counted by reason; a row that does not have
the format's columns (or is not an object, or not JSON) is malformed and stops the conversion
with a :class:`~hf_core.errors.DataError` naming the file and row -- nothing is written then.
Besides the data: ``report.json`` (rows kept and dropped, and why) and ``preview.txt`` (the
first rows as the model will see them: rendered through the chat template when a tokenizer is
given).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hf_core.atomic import replaced_atomically
from hf_core.data.answers import gsm8k_final_answer, last_boxed
from hf_core.data.io import read_records, write_jsonl
from hf_core.data.prepare_images import DECODED, check_images, row_images, write_images
from hf_core.data.prepare_pairs import preference_preview, preference_record
from hf_core.data.prepare_sft import sft_preview, sft_record
from hf_core.engines.hf_folder import read_model_config
from hf_core.errors import DataError
from hf_core.renamed import HF_MEANS_HYBRIDFLOW, renamed

if TYPE_CHECKING:
    from hf_core.multimodal.vision import VisionProcessor

Format = Literal["gsm8k", "math", "datasets", "jsonl", "vlm", "sft", "preference"]
Extract = Literal["none", "gsm8k", "boxed"]
FORMATS: tuple[str, ...] = ("gsm8k", "math", "datasets", "jsonl", "vlm", "sft", "preference")
#: Formats whose records are conversations (no prompt template, no ground truth).
CHAT_FORMATS: tuple[str, ...] = ("sft", "preference")
RENAMED_FORMATS: dict[str, str] = {"hf": "datasets"}
"""Retired format names -> the current ones (refused with the new name: :func:`check_format`)."""
EXTRACTS: tuple[str, ...] = ("none", "gsm8k", "boxed")

#: ``{question}`` is replaced by the row's question (no other braces are interpreted, so LaTeX
#: in a template stays as written).
DEFAULT_TEMPLATES: dict[str, str] = {
    "gsm8k": (
        '{question}\nLet\'s think step by step and write the final answer as a number after "####".'
    ),
    "math": "{question}\nLet's think step by step and put the final answer in \\boxed{}.",
    "datasets": "{question}",
    "jsonl": "{question}",
    "vlm": "{question}",
}
#: (question column, answer column, answer extraction) of the fixed formats.
_FORMAT_COLUMNS: dict[str, tuple[str, str, Extract]] = {
    "gsm8k": ("question", "answer", "gsm8k"),
    "math": ("problem", "solution", "boxed"),
}
#: Columns of the MATH benchmark kept beside the prompt.
_MATH_EXTRAS = ("level", "type")
PREVIEW_FILE = "preview.txt"
REPORT_FILE = "report.json"
_DROPPED_LISTED = 20


@dataclass(frozen=True)
class PrepareOptions:
    """What ``hybridflow data prepare`` was asked to do (see the module doc)."""

    fmt: Format
    inputs: Sequence[Path]
    output: Path
    template: str | None = None
    system: str | None = None
    prompt_key: str = "question"
    answer_key: str = "answer"
    extract: Extract = "none"
    tokenizer: Path | None = None
    preview_rows: int = 3
    image_key: str = "images"
    max_image_tokens: int | None = None

    def __post_init__(self) -> None:
        check_format(self.fmt)


def check_format(fmt: str) -> str:
    """``fmt`` if it is a format; a retired name is refused naming the new one, another
    unknown name listing the formats (:class:`~hf_core.errors.DataError` either way)."""
    if fmt in RENAMED_FORMATS:
        raise DataError(renamed("format", fmt, RENAMED_FORMATS[fmt], HF_MEANS_HYBRIDFLOW))
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}; the formats: {', '.join(FORMATS)}")
    return fmt


@dataclass
class SplitReport:
    """One input's outcome: the file written, rows kept, rows dropped by reason."""

    source: str
    output: str
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    dropped_rows: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": self.output,
            "kept": self.kept,
            "dropped": sum(self.dropped.values()),
            "dropped_by_reason": dict(sorted(self.dropped.items())),
            "dropped_rows": self.dropped_rows,
        }


@dataclass(frozen=True)
class _Row:
    """A row read from an input, with where it came from (for messages)."""

    values: Any
    where: str
    index: int
    base: Path | None = None
    """The folder a relative image path resolves against (the input file's)."""


# ----------------------------------------------------------------- answers
def extract_answer(text: str, rule: Extract) -> str | None:
    if rule == "gsm8k":
        return gsm8k_final_answer(text)
    if rule == "boxed":
        return last_boxed(text)
    stripped = text.strip()
    return stripped or None


# ------------------------------------------------------------------ reading
def _read_problem(path: Path, index: int) -> _Row:
    """One MATH problem file: a single JSON object (usually spread over several lines)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}: row 0 (line {e.lineno}): malformed JSON ({e.msg} at column {e.colno})"
        ) from None
    return _Row(value, f"{path}: row 0", index)


def _read_math_folder(folder: Path) -> Iterator[_Row]:
    files = sorted(p for p in folder.rglob("*.json") if p.is_file())
    if not files:
        raise DataError(f"{folder}: a MATH folder needs *.json problem files; found none")
    for index, path in enumerate(files):
        yield _read_problem(path, index)


def _is_single_object(path: Path) -> bool:
    """A ``.json`` file holding one object (a MATH problem file), not an array or JSON Lines."""
    if path.suffix.lower() != ".json":
        return False
    try:
        return isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
    except json.JSONDecodeError:
        return False


def _read_files(path: Path) -> Iterator[_Row]:
    for values, location in read_records(path):
        line = f" (line {location.line})" if location.line is not None else ""
        where = f"{location.path}: row {location.record}{line}"
        yield _Row(values, where, location.record, Path(location.path).parent)


def _load_saved_dataset(path: Path) -> list[tuple[str, Any]]:
    """(name, dataset) of each split of a ``save_to_disk`` folder."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"reading {path} needs the 'datasets' package: pip install 'hf-core[data]'"
        ) from None
    if not path.is_dir():
        raise DataError(f"{path}: a saved 'datasets' dataset is a folder (save_to_disk)")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError / ValueError / its own types
        raise DataError(f"{path}: not a dataset saved with save_to_disk: {e}") from e
    if isinstance(loaded, datasets.DatasetDict):
        return [(str(split), loaded[split]) for split in loaded]
    return [(path.name, loaded)]


def _saved_dataset_rows(path: Path, split: str, dataset: Any) -> Iterator[_Row]:
    for index, values in enumerate(dataset):
        yield _Row(values, f"{path}[{split}]: row {index}", index)


def _sources(options: PrepareOptions) -> Iterator[tuple[str, str, Iterator[_Row]]]:
    """(output name, source description, rows) for each input (each split of a saved dataset)."""
    for path in options.inputs:
        path = Path(path)
        if not path.exists():
            raise DataError(f"input {path} does not exist (absolute: {path.absolute()})")
        if options.fmt == "datasets":
            for split, dataset in _load_saved_dataset(path):
                yield split, f"{path}[{split}]", _saved_dataset_rows(path, split, dataset)
        elif options.fmt == "math" and path.is_dir():
            yield path.name, str(path), _read_math_folder(path)
        elif options.fmt == "math" and _is_single_object(path):
            yield path.stem, str(path), iter([_read_problem(path, 0)])
        elif path.is_dir():
            raise DataError(f"input {path} is a folder; the {options.fmt} format reads files")
        else:
            yield path.stem, str(path), _read_files(path)


# --------------------------------------------------------------- converting
def _columns(options: PrepareOptions) -> tuple[str, str, Extract]:
    if options.fmt in _FORMAT_COLUMNS:
        return _FORMAT_COLUMNS[options.fmt]
    return options.prompt_key, options.answer_key, options.extract


def _text(row: _Row, key: str, fmt: str) -> str:
    """The string in column ``key``; a missing column or another type is a malformed row."""
    if not isinstance(row.values, dict):
        raise DataError(
            f"{row.where}: expected an object with {key!r}, got {type(row.values).__name__}"
        )
    if key not in row.values:
        present = ", ".join(sorted(map(str, row.values))) or "none"
        raise DataError(
            f"{row.where}: no {key!r} field, which the {fmt} format needs (fields: {present})"
        )
    value = row.values[key]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise DataError(f"{row.where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def _prompt(question: str, options: PrepareOptions, template: str) -> Any:
    text = template.replace("{question}", question)
    if options.system is None:
        return text
    return [{"role": "system", "content": options.system}, {"role": "user", "content": text}]


def convert_row(
    row: _Row, options: PrepareOptions, template: str | None, vision: VisionProcessor | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """The output record of ``row``, or ``(None, reason)`` when the row is dropped."""
    if options.fmt == "sft":
        return sft_record(row.values, row.where, row.index, options.system)
    if options.fmt == "preference":
        return preference_record(row.values, row.where, row.index, options.system)
    assert template is not None
    question_key, answer_key, rule = _columns(options)
    question = _text(row, question_key, options.fmt).strip()
    answer = _text(row, answer_key, options.fmt)
    if not question:
        return None, f"empty {question_key}"
    truth = extract_answer(answer, rule)
    if truth is None:
        reasons = {
            "gsm8k": f"no final answer after '####' in {answer_key}",
            "boxed": f"no \\boxed{{...}} answer in {answer_key}",
            "none": f"empty {answer_key}",
        }
        return None, reasons[rule]
    record: dict[str, Any] = {
        "prompt": _prompt(question, options, template),
        "ground_truth": truth,
        "data_source": options.fmt,
        "source_row": row.index,
    }
    if options.fmt == "math":
        record.update({k: row.values[k] for k in _MATH_EXTRAS if k in row.values})
    if options.fmt == "vlm":
        images = row_images(row.values, options.image_key)
        record[DECODED] = check_images(question, images, row.where, row.base, vision)
    return record, None


def _template(options: PrepareOptions) -> str | None:
    if options.fmt in CHAT_FORMATS:
        if options.template is not None:
            raise DataError(
                f"the {options.fmt} format takes no prompt template (its rows are "
                "conversations); drop --template"
            )
        return None
    template = options.template if options.template is not None else DEFAULT_TEMPLATES[options.fmt]
    if "{question}" not in template:
        raise DataError(f"the prompt template must contain '{{question}}', got {template!r}")
    return template


def prepare(options: PrepareOptions) -> list[SplitReport]:
    """Convert every input (see the module doc); returns one report per output file.

    Every input is read and checked before anything is written, so a malformed row leaves the
    output folder untouched.
    """
    if options.fmt not in FORMATS:
        raise DataError(f"unknown format {options.fmt!r}; expected one of {', '.join(FORMATS)}")
    if options.extract not in EXTRACTS:
        raise DataError(f"unknown extract rule {options.extract!r}; one of {', '.join(EXTRACTS)}")
    if not options.inputs:
        raise DataError("no input files given")
    template = _template(options)
    tokenizer = _load_tokenizer(options.tokenizer) if options.tokenizer is not None else None
    vision = _vision(options, tokenizer)
    outputs: dict[str, tuple[SplitReport, list[dict[str, Any]]]] = {}
    for name, source, rows in _sources(options):
        if name in outputs:
            raise DataError(
                f"two inputs would both write {name}.jsonl ({outputs[name][0].source} and "
                f"{source}); give files with different names"
            )
        report = SplitReport(source, str(options.output / f"{name}.jsonl"))
        records: list[dict[str, Any]] = []
        for row in rows:
            record, reason = convert_row(row, options, template, vision)
            if record is None:
                assert reason is not None
                report.dropped[reason] += 1
                if len(report.dropped_rows) < _DROPPED_LISTED:
                    report.dropped_rows.append({"row": row.where, "reason": reason})
                continue
            records.append(record)
        report.kept = len(records)
        if not records:
            raise DataError(f"{source}: no usable rows ({_reasons(report)})")
        outputs[name] = (report, records)
    for name, (report, records) in outputs.items():
        write_images(options.output, name, records)
        write_jsonl(records, report.output)
    reports = [report for report, _ in outputs.values()]
    _write_report(options, reports)
    _write_preview(options, outputs, tokenizer)
    return reports


def _reasons(report: SplitReport) -> str:
    return "; ".join(f"{n} {reason}" for reason, n in sorted(report.dropped.items())) or "empty"


# ----------------------------------------------------------- report/preview
def _write_report(options: PrepareOptions, reports: list[SplitReport]) -> None:
    body = {
        "format": options.fmt,
        "template": _template(options),
        "system": options.system,
        "outputs": [r.as_dict() for r in reports],
    }
    _write_text(options.output / REPORT_FILE, json.dumps(body, indent=2, ensure_ascii=False))


def _vision(options: PrepareOptions, tokenizer: Any) -> VisionProcessor | None:
    """The image checks of a vision-language ``--tokenizer`` folder (``vlm`` format only)."""
    if options.fmt != "vlm" or options.tokenizer is None:
        return None
    from hf_core.multimodal.vision import VisionProcessor, is_vision_model  # torch

    if not (options.tokenizer / "config.json").is_file():
        return None
    if not is_vision_model(read_model_config(options.tokenizer, key="--tokenizer")):
        return None
    return VisionProcessor(options.tokenizer, tokenizer, options.max_image_tokens)


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError for a bad folder
        raise DataError(f"--tokenizer {path}: cannot load a tokenizer: {e}") from e


def render_prompt(prompt: Any, tokenizer: Any) -> str:
    """The prompt as the model reads it: the chat template applied when the tokenizer has one
    (as the trainer's dataset does by default), else the plain text."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return str(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        )
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"[{m['role']}] {m['content']}" for m in prompt)


def _write_preview(
    options: PrepareOptions,
    outputs: dict[str, tuple[SplitReport, list[dict[str, Any]]]],
    tokenizer: Any,
) -> None:
    how = "chat template of " + str(options.tokenizer) if tokenizer is not None else "plain text"
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        how = f"plain text ({options.tokenizer} has no chat template)"
    lines = [f"# first {options.preview_rows} rows of each output, as the model sees them ({how})"]
    for report, records in outputs.values():
        dropped = sum(report.dropped.values())
        why = f" ({_reasons(report)})" if dropped else ""
        lines.append(f"\n## {report.output}: {report.kept} kept, {dropped} dropped{why}")
        for record in records[: options.preview_rows]:
            if options.fmt in CHAT_FORMATS:
                preview = sft_preview if options.fmt == "sft" else preference_preview
                lines += preview(record, tokenizer)
                continue
            lines += [
                f"\n--- row {record['source_row']} prompt ---",
                render_prompt(record["prompt"], tokenizer),
                f"--- ground truth: {record['ground_truth']}",
            ]
    _write_text(options.output / PREVIEW_FILE, "\n".join(lines) + "\n")


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
