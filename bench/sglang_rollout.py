"""SGLang rollout engine vs the HF (and, where installed, vLLM) engine: tokens/s and sync time.

The batch is the one ``bench/rollout_throughput.py`` uses for vLLM vs HF: 64 left-padded
prompts of random ids (8-24 tokens, seed 0) x 64 new tokens each with no early stop
(SGLang and vLLM with ``ignore_eos``, HF with its EOS list emptied), temperature 1.0,
float32, on the same tiny Qwen2 shapes.  Throughput = generated tokens / wall seconds of one
``generate`` call after one unmeasured warm-up; median of ``--repeats``.  Weight sync = one
full canonical stream (HF state-dict names, tied ``lm_head`` left out) in buckets of
``--bucket-mb`` through ``load_weights`` + ``finish_weight_sync`` (SGLang: both transports);
median of ``--repeats`` after a warm-up sync.  Every engine runs in its own fresh process, one
after the other; SGLang's model runner is a child process of it.

Usage: python bench/sglang_rollout.py [--sizes tiny,small] [--threads 2] [--write]
       [--vllm-python /path/to/venv-with-hf-vllm/bin/python]
(needs hf-fsdp and hf-sglang with SGLang; on CPU the harness of packages/hf-sglang/tests).
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

SECTION = "## SGLang rollout engine: tokens/s and weight sync (`bench/sglang_rollout.py`)"
ENGINES = {  # name -> (registered rollout engine, settings, weight-sync transports)
    "transformers": ("transformers", {"max_batch_size": 256}, [None]),
    "sglang": ("sglang", {"ignore_eos": True, "device": "cpu"}, ["tensor", "distributed"]),
    "vllm": ("vllm", {"ignore_eos": True}, [None]),
}


def canonical_stream(path: Path):  # -> list of (name, tensor)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    tied = model.config.tie_word_embeddings
    return [(k, v) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")]


def timed_sync(engine: object, stream: list, bucket_bytes: int) -> float:
    from hf_core.engines import iter_buckets

    start = time.perf_counter()
    for bucket in iter_buckets(stream, bucket_bytes):
        engine.load_weights(bucket)
    engine.finish_weight_sync()
    return time.perf_counter() - start


def child(args: argparse.Namespace) -> None:
    """Measure one engine on one model; print a JSON line."""
    import torch

    from hf_core.plugins import get_rollout_engine

    torch.set_num_threads(args.threads)
    name, settings, transports = ENGINES[args.child]
    path = Path(args.model)
    start = time.perf_counter()
    engine = get_rollout_engine(name)(model_path=str(path), **settings)
    startup = time.perf_counter() - start
    if args.child == "transformers":
        engine.eos_token_ids = []  # decode to max_new_tokens, like ignore_eos
    tokens, rates = measure_generate(engine, path, args)
    stream = canonical_stream(path)
    syncs: dict[str, list[float]] = {}
    for transport in transports:
        if transport is not None:
            from hf_sglang.engine import make_transport

            engine.transport.close()
            config = engine.config.model_copy(update={"weight_sync": transport})
            engine.transport = make_transport(engine.engine, config, engine.device)
        bucket = int(args.bucket_mb * 2**20)
        timed_sync(engine, stream, bucket)  # warm-up (and the distributed group's set-up)
        syncs[transport or "in place"] = [
            timed_sync(engine, stream, bucket) for _ in range(args.repeats)
        ]
    if hasattr(engine, "close"):
        engine.close()
    print_result({"tokens": tokens, "rates": rates, "startup": startup, "syncs": syncs})


def measure(engine: str, model: Path, threads: int, args: argparse.Namespace) -> dict:
    python = args.vllm_python if engine == "vllm" else sys.executable
    cmd = [python, __file__, "--child", engine, "--model", str(model)]
    cmd += ["--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens)]
    cmd += ["--repeats", str(args.repeats), "--threads", str(threads)]
    cmd += ["--bucket-mb", str(args.bucket_mb)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # SGLang's model runner inherits it
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return run_child(cmd, env, f"{engine} on {model.name}")


def table(rows: list, args: argparse.Namespace) -> str:
    lines = [
        SECTION,
        "",
        f"{args.prompts} prompts (random ids, 8-24 tokens, left-padded; the batch of "
        f"`bench/rollout_throughput.py`) x {args.new_tokens} new tokens each, no early stop, "
        "temperature 1.0, float32, one engine per fresh process at the thread count shown "
        "(`OMP_NUM_THREADS`, inherited by SGLang's model-runner process). Median of "
        f"{args.repeats} `generate` calls after one warm-up. Sync = the whole model as a "
        f"canonical stream in {args.bucket_mb:g} MiB buckets, `load_weights` + "
        f"`finish_weight_sync`, median of {args.repeats} after a warm-up. SGLang 0.5.23 on the "
        "CPU test harness (`torch_native` attention; its GPU product path is not measured here).",
        "",
        machine_line(load=True),
        "",
        "| model | params | engine | threads | tokens | median tokens/s | vs HF | start-up s "
        "| sync s (transport) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, params, engine, threads, res, rate, hf in rollout_table_rows(rows):
        syncs = ", ".join(f"{statistics.median(v):.3f} ({k})" for k, v in res["syncs"].items())
        lines.append(
            f"| {label} | {params} | {engine} | {threads} | {res['tokens']} | "
            f"{rate:,.0f} | {rate / hf:.2f}x | {res['startup']:.1f} | {syncs} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rollout_args(parser, threads="2")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--vllm-python", help="a Python with hf-vllm + vLLM: adds vLLM rows")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    parser.add_argument("--child", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.threads = int(args.threads)
        child(args)
        return

    engines = ["transformers", "sglang", *(["vllm"] if args.vllm_python else [])]
    rows = rollout_matrix(engines, measure, args, "hf-sglang-bench-")
    publish(SECTION, table(rows, args), args.write)


if __name__ == "__main__":
    main()
