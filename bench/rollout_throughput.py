"""Rollout throughput: the vLLM engine against the transformers rollout engine on the same batch.

Both engines get the same left-padded prompts (random ids, 8-24 tokens) and decode exactly
``--new-tokens`` tokens each (the transformers engine with its EOS list emptied, the vLLM engine
with ``ignore_eos``), sampling at temperature 1.0, float32.  Throughput = generated tokens / wall
seconds of one ``generate`` call, after one unmeasured warm-up call; the median of
``--repeats`` calls is reported.  Every engine runs in its own process (a fresh interpreter at
each of the ``--threads`` torch thread counts), one after the other, so they never share the
cores with each other (other work on the machine may: its load average is recorded).

Usage: python bench/rollout_throughput.py [--sizes tiny,small] [--threads 1,2] [--compiled]
[--write]
(needs hf-fsdp and hf-vllm with vLLM installed; set VLLM_CPU_KVCACHE_SPACE=1 on CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from _common import (
    add_rollout_args,
    machine_line,
    measure_generate,
    print_result,
    publish,
    rollout_matrix,
    rollout_table_rows,
    run_child,
)

SECTION = "## Rollout throughput: vLLM vs transformers engine (`bench/rollout_throughput.py`)"
ENGINES = ("transformers", "vllm", "vllm-compiled")
NOTE = (
    "With 2 threads on these 2 shared cores both engines slow down several-fold and vary "
    "widely run to run (idle OpenMP workers spin between the decode loop's short parallel ops "
    "while other work holds the cores): trust the 1-thread rows, which are also the vLLM "
    "engine's default (`torch_threads=1`). vLLM's lead grows with model size: on tiny models "
    "both engines are bound by per-step Python overhead. torch.compile "
    "(`enforce_eager=False`) adds 20-40 s of start-up."
)


def _build_engine(engine: str, path: Path, threads: int):
    if engine == "transformers":
        from hf_fsdp.rollout import TransformersRolloutEngine

        hf = TransformersRolloutEngine({"model_path": str(path), "max_batch_size": 256})
        hf.eos_token_ids = []  # decode to max_new_tokens, like vLLM's ignore_eos
        return hf
    from hf_vllm.engine import VLLMRolloutEngine

    return VLLMRolloutEngine(
        {
            "model_path": str(path),
            "ignore_eos": True,
            "enforce_eager": engine == "vllm",
            "torch_threads": threads,  # what vLLM decodes with (the engine's default is 1)
        }
    )


def _child(args: argparse.Namespace) -> None:
    """Measure one engine on one model; print a JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    path = Path(args.model)
    start = time.perf_counter()
    engine = _build_engine(args.engine, path, args.threads)
    startup = time.perf_counter() - start
    tokens, rates = measure_generate(engine, path, args)
    threads = torch.get_num_threads()
    print_result({"tokens": tokens, "rates": rates, "startup": startup, "threads": threads})


def _measure(engine: str, model: Path, threads: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--model", str(model)]
    cmd += ["--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens)]
    cmd += ["--repeats", str(args.repeats), "--threads", str(threads)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return run_child(cmd, env, f"{engine} on {model.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rollout_args(parser, threads="1,2")
    parser.add_argument("--compiled", action="store_true", help="also vLLM with torch.compile")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.engine, args.threads = args.child, int(args.threads)
        _child(args)
        return

    engines = ["transformers", "vllm", *(["vllm-compiled"] if args.compiled else [])]
    rows = rollout_matrix(engines, _measure, args, "hf-rollout-bench-")

    lines = [
        SECTION,
        "",
        f"{args.prompts} prompts (random ids, 8-24 tokens, left-padded) x {args.new_tokens} new "
        "tokens each (no early stop: HF with its EOS list emptied, vLLM with `ignore_eos`), "
        "temperature 1.0, float32, one engine per process at the torch thread count shown. "
        f"Median of {args.repeats} `generate` calls after one warm-up; tokens/s = generated "
        "tokens / wall seconds of the call (start-up excluded, shown apart). vLLM: vllm-cpu "
        "0.32.0, in-process (`uni` executor), eager unless marked compiled.",
        "",
        machine_line(load=True),
        "",
        "| model | params | engine | threads | tokens | median tokens/s | min-max tokens/s "
        "| start-up s | vs HF, same threads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, params, engine, threads, res, rate, hf_rate in rollout_table_rows(rows):
        lines.append(
            f"| {label} | {params} | {engine} | {threads} | {res['tokens']} | "
            f"{rate:,.0f} | {min(res['rates']):,.0f}-{max(res['rates']):,.0f} | "
            f"{res['startup']:.1f} | {rate / hf_rate:.1f}x |"
        )
    lines.append("")
    for size, _, results in rows:
        best = {
            engine: max(
                statistics.median(r["rates"]) for (e, _), r in results.items() if e == engine
            )
            for engine in engines
        }
        fastest = max((e for e in engines if e != "transformers"), key=best.get)
        lines.append(
            f"Result ({size}): best vLLM ({fastest}) {best[fastest]:,.0f} tokens/s vs best HF "
            f"{best['transformers']:,.0f} tokens/s = {best[fastest] / best['transformers']:.1f}x."
        )
    lines += ["", NOTE]
    publish(SECTION, "\n".join(lines) + "\n", args.write)


if __name__ == "__main__":
    main()
