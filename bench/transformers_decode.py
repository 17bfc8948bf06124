"""The transformers engine's decode loop against transformers' ``generate`` on the same batch.

The bench model of ``bench/e2e_throughput.py`` (tiny Qwen2, 0.85 M parameters, float32) and
its prompts, left-padded, each repeated ``n`` times, decoded to exactly ``new tokens`` at
temperature 1.0 (no top-k / top-p) by:

- ``transformers generate``: ``model.generate(do_sample=True)`` on the plain HF model, with
  ``min_new_tokens`` = ``max_new_tokens`` (what a trainer built on transformers alone does);
- ``engine, decoder=transformers``: the transformers engine's loop over transformers' forward
  (``DynamicCache``), with its default oneDNN linear layers;
- ``engine, decoder=auto``: the default, the lean Llama-family decoder (``hf_fsdp.decoder``).

The two engines decode with their EOS list emptied, so every contender produces the same
number of tokens.  Each batch runs in a fresh process at the torch thread count shown, with
the worker processes' environment (huge pages); the contenders take turns within it, one
warm-up call each, then ``--repeats`` rounds; the median call counts.

    python bench/transformers_decode.py [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import bench_model, print_result, publish, run_child, section
from e2e_throughput import task_prompts, worker_env, write_task

TITLE = "## transformers engine's decode vs transformers' generate (`bench/transformers_decode.py`)"
CASES = (("small", 8, 4, 32, 2), ("large share", 32, 4, 64, 1))
"""(name, prompts, samples per prompt, new tokens, torch threads): the e2e bench's small step
on its best layout (1 process x 2 threads) and one rank's share of its large step on its best
layout (2 processes x 1 thread)"""
CONTENDERS = ("transformers generate", "engine, decoder=transformers", "engine, decoder=auto")


def child(args: argparse.Namespace) -> None:
    """One batch, every contender in turn (``--child``)."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from hf_core.engines import SamplingParams, special_tokens
    from hf_fsdp.rollout import TransformersRolloutEngine

    prompts = task_prompts(args.model, args.data, 0, args.prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.n, seed=1)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = prompts["input_ids"].repeat_interleave(args.n, 0)
    mask = prompts["attention_mask"].repeat_interleave(args.n, 0)
    pad_token_id = special_tokens(Path(args.model)).pad_token_id

    def transformers_generate() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=pad_token_id,
            )
        return int(out[:, ids.shape[1] :].numel())

    def engine_call(decoder: str) -> Any:
        engine = TransformersRolloutEngine({"model_path": args.model, "decoder": decoder})
        engine.eos_token_ids = []  # decode to max_new_tokens, as generate above does

        def call() -> int:
            return int(engine.generate(prompts, params)["response_mask"].sum())

        return call

    calls = {
        "transformers generate": transformers_generate,
        "engine, decoder=transformers": engine_call("transformers"),
        "engine, decoder=auto": engine_call("auto"),
    }
    tokens = {name: call() for name, call in calls.items()}  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            tokens[name] = call()
            seconds[name].append(time.perf_counter() - start)
    print_result({"tokens": tokens, "seconds": seconds})


def run_case(model: Path, data: Path, case: tuple, repeats: int) -> dict[str, Any]:
    name, prompts, n, new_tokens, threads = case
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--data", str(data)]
    cmd += ["--prompts", str(prompts), "--n", str(n), "--new-tokens", str(new_tokens)]
    cmd += ["--threads", str(threads), "--repeats", str(repeats)]
    return run_child(cmd, worker_env(threads), f"transformers_decode {name}")


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| batch | sequences x new tokens | threads | decoder | median s | tokens/s "
        "| vs generate |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = []
    for (name, prompts, n, new_tokens, threads), res in zip(CASES, results.values(), strict=True):
        median = {c: statistics.median(res["seconds"][c]) for c in CONTENDERS}
        base = median["transformers generate"]
        for contender in CONTENDERS:
            rate = res["tokens"][contender] / median[contender]
            lines.append(
                f"| {name} | {prompts * n} x {new_tokens} | {threads} | {contender} "
                f"| {median[contender]:.3f} | {rate:,.0f} | {base / median[contender]:.2f}x |"
            )
        summary.append(
            f"- {name}: the default decoder takes {median['engine, decoder=auto']:.3f} s "
            f"against transformers' generate {base:.3f} s "
            f"({base / median['engine, decoder=auto']:.2f}x faster)"
        )
    return "\n".join([*lines, "", *summary])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="measured rounds per contender")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--model", "--data"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--prompts", "--n", "--new-tokens", "--threads"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    with tempfile.TemporaryDirectory(prefix="hf-decode-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = bench_model("0.85M")
        data = write_task(tmp / "train.jsonl", rows=64)
        results = {case[0]: run_case(model, data, case, args.repeats) for case in CASES}
    description = (
        "The bench model of `bench/e2e_throughput.py` (tiny Qwen2, 0.85 M parameters, "
        "float32) and its prompts, each repeated for its samples, decoded to exactly the "
        "new tokens shown at temperature 1.0 by transformers' `generate(do_sample=True)` "
        "and by the transformers engine (EOS list emptied) with either decoder; one process "
        f"per batch, the contenders taking turns, median of {args.repeats} calls after a "
        "warm-up each."
    )
    text = section(TITLE, description, table(results))
    publish(TITLE, text, args.write)


if __name__ == "__main__":
    main()
