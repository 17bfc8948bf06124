"""GRPO at real sizes on a GPU node: the loop (Ray, FSDP2 or megatron, transformers engine on CUDA).

Every row runs ``hybridflow run`` with default settings on one process per GPU (FSDP's
``mixed_precision: auto`` is bfloat16 compute over float32 master weights on CUDA), and prints
seconds per stage, tokens/s, the train/rollout log-prob mismatch and peak device memory per
process.  Models are the real shapes of ``hf_testing.real_shapes`` with random weights, so
responses run to their length limit.  ``nox -s gpu`` runs it after the GPU tests.

    python bench/gpu_loop.py                     # every row
    python bench/gpu_loop.py --rows 0.5B-small   # one row
    python bench/gpu_loop.py --out rows.jsonl    # and keep each row as a JSON line
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from _common import grpo_overrides
from e2e_throughput import write_task
from scale import STAGES, hybridflow, median

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "runs" / "bench-models"
FP32_ROLLOUT = ["rollout.engine.dtype=float32"]
ROWS: dict[str, dict[str, Any]] = {
    # name: shape, prompts x samples, new tokens, extra overrides.  The transformers engine's
    # default dtype (auto) is bfloat16 on CUDA; the -fp32 row pins float32 to show what that buys.
    "0.5B-small": {"shape": "qwen2.5-0.5b", "batch": (4, 4), "new": 32, "extra": []},
    "0.5B-small-fp32": {"shape": "qwen2.5-0.5b", "batch": (4, 4), "new": 32,
                        "extra": FP32_ROLLOUT},
    "0.5B": {"shape": "qwen2.5-0.5b", "batch": (32, 8), "new": 256, "extra": []},
    "1.5B": {"shape": "qwen2.5-1.5b", "batch": (32, 8), "new": 256, "extra": []},
    "0.5B-small-megatron": {"shape": "qwen2.5-0.5b", "batch": (4, 4), "new": 32,
                            "actor": "megatron", "extra": []},
}  # fmt: skip
STEPS, WARMUP = 4, 1
STAGE_PEAK = re.compile(r"memory/\w+_peak_gib")


def row_overrides(row: dict[str, Any], model: Path, data: Path, out: Path, gpus: int) -> list[str]:
    prompts, samples = row["batch"]
    return grpo_overrides(
        model,
        data,
        out,
        prompts=prompts,
        samples=samples,
        new_tokens=row["new"],
        steps=STEPS,
        processes=gpus,
        lr="1e-6",
        extra=[
            f"actor.backend={row.get('actor', 'fsdp')}",
            "rollout.backend=transformers",
            *row["extra"],
        ],
    )


def measure(name: str, work: Path, data: Path, gpus: int) -> dict[str, Any]:
    from hf_testing.real_shapes import cached_shape_model

    row = ROWS[name]
    model = cached_shape_model(row["shape"], CACHE)
    out = work / name
    rows, _log = hybridflow(row_overrides(row, model, data, out, gpus), out)
    measured = rows[WARMUP:]
    # each stage's peak device memory on its largest rank (the workers' CUDA allocator)
    peaks = [float(v) for r in rows for k, v in r.items() if STAGE_PEAK.fullmatch(k)]
    return {
        "row": name,
        "gpus": gpus,
        "step_s": median(measured, "perf/step_s"),
        "tokens_per_s": median(measured, "perf/throughput"),
        "stages": {s: median(measured, f"timing/{s}") for s in STAGES},
        "logprob_abs_diff_mean": median(measured, "rollout/logprob_abs_diff_mean"),
        "peak_cuda_gib": max(peaks, default=None),
        "response_length": median(measured, "response_length/mean"),
    }


def table(results: list[dict[str, Any]]) -> str:
    def cell(value: float | None, fmt: str = ".2f") -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        "| row | GPUs | step s | tokens/s | generate s | update s | sync s | peak GPU GiB "
        "| mean |logp diff| |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["stages"]
        lines.append(
            f"| {r['row']} | {r['gpus']} | {cell(r['step_s'])} | {cell(r['tokens_per_s'], '.0f')} "
            f"| {cell(s['generate'])} | {cell(s['update_actor'])} "
            f"| {cell(s['weight_sync'], '.3f')} "
            f"| {cell(r['peak_cuda_gib'])} | {cell(r['logprob_abs_diff_mean'], '.1e')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--out", type=Path, help="append each row to this JSONL file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_loop.py measures the loop on CUDA GPUs; torch sees none")
    gpus = args.gpus or torch.cuda.device_count()
    results = []
    with tempfile.TemporaryDirectory(prefix="hf-gpu-loop-") as tmp:
        work = Path(tmp)
        data = write_task(work / "task.jsonl", rows=1024)
        for name in args.rows.split(","):
            print(f"{name} on {gpus} GPU(s) ...", flush=True)
            try:
                result = measure(name, work, data, gpus)
            except RuntimeError as exc:
                errors = work / name / "error.log"
                detail = errors.read_text()[-6000:] if errors.is_file() else ""
                print(f"  failed: {exc}\n{detail}", flush=True)
                continue
            print(f"  {json.dumps(result)}", flush=True)
            results.append(result)
            if args.out is not None:
                with args.out.open("a") as fh:
                    fh.write(json.dumps(result) + "\n")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(results))


if __name__ == "__main__":
    main()
