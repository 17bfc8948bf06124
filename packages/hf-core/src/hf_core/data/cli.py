"""``hybridflow data prepare FORMAT --input ... --output DIR``: public dataset formats to the
prompt / ground-truth files a recipe reads (see :mod:`hf_core.data.prepare`).

Kept beside the converter so the data package owns its command; the top-level CLI wires it in
with :func:`add_data_command`.  Bad input raises :class:`~hf_core.errors.DataError`, which the
top-level CLI reports with exit code 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hf_core.data.prepare import (
    DEFAULT_TEMPLATES,
    EXTRACTS,
    FORMATS,
    PREVIEW_FILE,
    RENAMED_FORMATS,
    REPORT_FILE,
    PrepareOptions,
    check_format,
    prepare,
)
from hf_core.errors import DataError


def add_data_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``data prepare`` to a subparsers object (``handler=run_prepare``)."""
    data = subparsers.add_parser("data", help="prepare datasets for the recipes")
    actions = data.add_subparsers(dest="data_command", required=True)
    parser = actions.add_parser(
        "prepare",
        help="convert GSM8K / MATH / a saved datasets dataset / JSONL-Parquet columns / "
        "image+question+answer rows (vlm) / chat or prompt-completion demonstrations (sft) / "
        "chosen-rejected pairs (preference)",
        description=(
            "Write <output>/<name>.jsonl (prompt, ground_truth; sft: messages; preference: "
            "prompt, chosen, rejected) for each input, plus "
            f"{REPORT_FILE} (rows kept and dropped, and why) and {PREVIEW_FILE}.  Default "
            "prompt templates: "
            + "; ".join(f"{k}: {v!r}" for k, v in DEFAULT_TEMPLATES.items() if k != "datasets")
        ),
    )
    parser.add_argument("format", type=_format, choices=FORMATS, help="the input's format")
    parser.add_argument(
        "--input",
        dest="inputs",
        nargs="+",
        required=True,
        type=Path,
        help="local files (JSONL / JSON / Parquet), a MATH folder of *.json, or (datasets) a "
        "save_to_disk folder",
    )
    parser.add_argument("--output", required=True, type=Path, help="folder to write")
    parser.add_argument(
        "--template", help="prompt template with {question} (default: the format's)"
    )
    parser.add_argument("--system", help="a system prompt (the prompt becomes chat messages)")
    parser.add_argument(
        "--prompt-key", default="question", help="datasets/jsonl: the question column (question)"
    )
    parser.add_argument(
        "--answer-key", default="answer", help="datasets/jsonl: the answer column (answer)"
    )
    parser.add_argument(
        "--extract",
        choices=EXTRACTS,
        default="none",
        help="datasets/jsonl: take the ground truth after '####' (gsm8k), from the last \\boxed{} "
        "(boxed), or the whole answer (none)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a local tokenizer folder: the preview renders prompts with its chat template",
    )
    parser.add_argument("--preview-rows", type=int, default=3, help="rows per output to preview")
    parser.add_argument(
        "--image-key", default="images", help="vlm: the column with a row's image(s) (images)"
    )
    parser.add_argument(
        "--max-image-tokens",
        type=int,
        help="vlm with a vision-language --tokenizer folder: the most image tokens one image "
        "may take (default: the model's max_position_embeddings)",
    )
    parser.set_defaults(handler=run_prepare)
    return parser


def _format(name: str) -> str:
    """A retired format name is refused naming the new one (argparse shows the message)."""
    if name in RENAMED_FORMATS:
        try:
            check_format(name)
        except DataError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def run_prepare(args: argparse.Namespace) -> int:
    """Convert, then print one line per output; 0 on success (bad input raises DataError)."""
    options = PrepareOptions(
        fmt=args.format,
        inputs=args.inputs,
        output=args.output,
        template=args.template,
        system=args.system,
        prompt_key=args.prompt_key,
        answer_key=args.answer_key,
        extract=args.extract,
        tokenizer=args.tokenizer,
        preview_rows=args.preview_rows,
        image_key=args.image_key,
        max_image_tokens=args.max_image_tokens,
    )
    reports = prepare(options)
    table = Table(title=f"hybridflow data prepare {args.format}")
    for column in ("source", "output", "kept", "dropped", "why dropped"):
        table.add_column(column)
    for report in reports:
        why = "; ".join(f"{n} {reason}" for reason, n in sorted(report.dropped.items()))
        dropped = str(sum(report.dropped.values()))
        table.add_row(report.source, report.output, str(report.kept), dropped, why or "-")
    console = Console(width=200)
    console.print(table)
    console.print(f"report: {args.output / REPORT_FILE}  preview: {args.output / PREVIEW_FILE}")
    return 0
