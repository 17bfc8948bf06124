"""Rollout throughput: the vLLM engine against the HF rollout engine on the same batch.

Both engines get the same left-padded prompts (random ids, 8-24 tokens) and decode exactly
``--new-tokens`` tokens each (the HF engine with its EOS list emptied, the vLLM engine with
``ignore_eos``), sampling at temperature 1.0, float32.  Throughput = generated tokens / wall
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
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTION = "## Rollout throughput: vLLM vs HF engine (`bench/rollout_throughput.py`)"
SIZES = {  # head_dim >= 32: vllm-cpu's attention kernels need it
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4},
}
ENGINES = ("hf", "vllm", "vllm-compiled")
NOTE = (
    "With 2 threads on these 2 shared cores both engines slow down several-fold and vary "
    "widely run to run (idle OpenMP workers spin between the decode loop's short parallel ops "
    "while other work holds the cores): trust the 1-thread rows, which are also the vLLM "
    "engine's default (`torch_threads=1`). vLLM's lead grows with model size: on tiny models "
    "both engines are bound by per-step Python overhead. torch.compile "
    "(`enforce_eager=False`) adds 20-40 s of start-up."
)


def _prompts(count: int, vocab: int):  # -> Batch
    import torch

    from hf_core.batch import Batch

    gen = torch.Generator().manual_seed(0)
    width = 24
    ids = torch.zeros(count, width, dtype=torch.long)
    mask = torch.zeros(count, width, dtype=torch.long)
    for row in range(count):
        length = int(torch.randint(8, width + 1, (1,), generator=gen))
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=gen)
        mask[row, width - length :] = 1
    return Batch({"input_ids": ids, "attention_mask": mask})


def _build_engine(engine: str, path: Path, threads: int):
    if engine == "hf":
        from hf_fsdp.rollout import HFRolloutEngine

        hf = HFRolloutEngine({"model_path": str(path), "max_batch_size": 256})
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

    from hf_core.engines import SamplingParams

    torch.set_num_threads(args.threads)
    path = Path(args.model)
    start = time.perf_counter()
    engine = _build_engine(args.engine, path, args.threads)
    startup = time.perf_counter() - start
    from transformers import AutoConfig

    prompts = _prompts(args.prompts, AutoConfig.from_pretrained(path).vocab_size)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
    engine.generate(prompts, params)  # warm-up
    rates, tokens = [], 0
    for _ in range(args.repeats):
        begin = time.perf_counter()
        out = engine.generate(prompts, params)
        seconds = time.perf_counter() - begin
        tokens = int(out["response_mask"].sum())
        rates.append(tokens / seconds)
    print(
        "RESULT "
        + json.dumps(
            {
                "tokens": tokens,
                "rates": rates,
                "startup": startup,
                "threads": torch.get_num_threads(),
            }
        ),
        flush=True,
    )


def _measure(engine: str, model: Path, threads: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--model", str(model)]
    cmd += ["--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens)]
    cmd += ["--repeats", str(args.repeats), "--threads", str(threads)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} on {model.name} failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small", help=f"of {sorted(SIZES)}")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="torch thread counts to measure")
    parser.add_argument("--compiled", action="store_true", help="also vLLM with torch.compile")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.engine, args.threads = args.child, int(args.threads)
        _child(args)
        return

    from hf_testing.tiny import build_tiny_model

    engines = ["hf", "vllm", *(["vllm-compiled"] if args.compiled else [])]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-rollout-bench-") as tmp:
        for size in args.sizes.split(","):
            path = build_tiny_model(Path(tmp) / size, "qwen2", **SIZES[size])
            from transformers import AutoModelForCausalLM

            params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
            results = {}
            for threads in [int(t) for t in args.threads.split(",")]:
                for engine in engines:
                    res = results[engine, threads] = _measure(engine, path, threads, args)
                    rate = statistics.median(res["rates"])
                    print(f"{size} {engine} x{threads}: {rate:,.0f} tokens/s {res}", flush=True)
            rows.append((size, params, results))

    load = os.getloadavg()
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
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load average when done: "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min; cores shared)",
        "",
        "| model | params | engine | threads | tokens | median tokens/s | min-max tokens/s "
        "| start-up s | vs HF, same threads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size, params, results in rows:
        shape = SIZES[size]
        label = f"{size} (h{shape['hidden_size']}, {shape['num_layers']} layers)"
        for (engine, threads), res in results.items():
            rate = statistics.median(res["rates"])
            hf_rate = statistics.median(results["hf", threads]["rates"])
            lines.append(
                f"| {label} | {params / 1e6:.2f} M | {engine} | {threads} | {res['tokens']} | "
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
        fastest = max((e for e in engines if e != "hf"), key=best.get)
        lines.append(
            f"Result ({size}): best vLLM ({fastest}) {best[fastest]:,.0f} tokens/s vs best HF "
            f"{best['hf']:,.0f} tokens/s = {best[fastest] / best['hf']:.1f}x."
        )
    lines += ["", NOTE]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.write:
        path = Path(__file__).with_name("RESULTS.md")
        text = path.read_text() if path.exists() else "# Benchmark results\n"
        if SECTION in text:  # replace our previous section, keep everyone else's
            head, rest = text.split(SECTION, 1)
            nxt = rest.find("\n## ")
            text = head + section + (rest[nxt + 1 :] if nxt >= 0 else "")
        else:
            text = text.rstrip("\n") + "\n\n" + section
        path.write_text(text)
        print(f"written to {path}")


if __name__ == "__main__":
    main()
