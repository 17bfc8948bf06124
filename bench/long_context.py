"""Long responses: step time and peak memory of a policy update, packed against padded.

One FSDP training engine (1 process, float32, the default engine settings but
``sequence_packing``) takes PPO-clip steps on a mixed-length batch: 4 samples with 64-token
prompts and responses of R, R/2, R/4 and R/8 tokens, for each R in ``--lengths``.  Padded,
every sample is computed at the longest one's width; packed
(:mod:`hf_core.engines.sequence_packing`), the samples run back to back in one row with a
document mask, and the engine's ``padding_tokens_sum`` counter says how many padding tokens
were computed.  Each measurement runs in a fresh process (peak RSS is that process's); the
time is the median of ``--steps`` steps after one warm-up step.

Ulysses sequence parallelism (SP=2) is not built yet, so there is no SP column.

    python bench/long_context.py [--lengths 1024,2048,4096] [--model 0.85M] [--write]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

from _common import bench_model, machine_line, print_result, publish, run_child, section

TITLE = "## Long responses: packed against padded updates (`bench/long_context.py`)"
PROMPT = 64
SHARES = (1, 2, 4, 8)  # the batch's responses: R, R/2, R/4, R/8 tokens
GIB = 2**30


def long_batch(response: int, vocab: int):
    """The mixed-length batch: full prompts, responses right-padded to ``response``."""
    import torch

    from hf_core.batch import Batch
    from hf_core.engines import assemble_rollout

    gen = torch.Generator().manual_seed(0)
    rows = len(SHARES)
    prompts = Batch(
        {
            "input_ids": torch.randint(3, vocab, (rows, PROMPT), generator=gen),
            "attention_mask": torch.ones(rows, PROMPT, dtype=torch.long),
        }
    )
    lengths = torch.tensor([response // share for share in SHARES])
    mask = (torch.arange(response)[None] < lengths[:, None]).long()
    responses = torch.randint(3, vocab, (rows, response), generator=gen) * mask
    out = assemble_rollout(prompts, responses, mask, torch.zeros(rows, response), 1.0)
    out["old_log_probs"] = -4.0 + 0.3 * torch.randn(rows, response, generator=gen)
    out["advantages"] = torch.randn(rows, response, generator=gen)
    return out


def child(model: str, response: int, packed: bool, steps: int) -> None:
    from transformers import AutoConfig

    from hf_fsdp.engine import FSDPEngine
    from hf_testing.workers import policy_loss

    path = bench_model(model)
    batch = long_batch(response, AutoConfig.from_pretrained(path).vocab_size)
    engine = FSDPEngine({"model_path": str(path), "lr": 1e-5, "sequence_packing": packed})
    metrics = engine.train_step(batch, policy_loss)  # warm-up
    seconds = []
    for _ in range(steps):
        begin = time.perf_counter()
        metrics = engine.train_step(batch, policy_loss)
        seconds.append(time.perf_counter() - begin)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print_result(
        {
            "seconds": statistics.median(seconds),
            "peak": peak,
            "padding": metrics.get("padding_tokens_sum", 0.0),
            "tokens": int(batch["attention_mask"].sum()),
        }
    )


def measure(model: str, response: int, packed: bool, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(response), "--model", model]
    cmd += ["--steps", str(steps), "--packed" if packed else "--padded"]
    return run_child(cmd, dict(os.environ), f"R={response} packed={packed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096", help="longest responses R")
    parser.add_argument("--model", default="0.85M", help="a bench model size (_common)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--padded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child, args.packed, args.steps)
        return
    rows = []
    for response in (int(x) for x in args.lengths.split(",")):
        padded = measure(args.model, response, False, args.steps)
        packed = measure(args.model, response, True, args.steps)
        computed = len(SHARES) * (PROMPT + response)
        rows.append(
            f"| {response:,} | {packed['tokens']:,} / {computed:,} | {padded['seconds']:.2f} "
            f"| {packed['seconds']:.2f} | {padded['seconds'] / packed['seconds']:.2f}x "
            f"| {padded['padding']:,.0f} / {packed['padding']:,.0f} "
            f"| {padded['peak'] / GIB:.2f} / {packed['peak'] / GIB:.2f} |"
        )
        print(rows[-1], flush=True)
    body = (
        "| R | real / padded tokens | padded s | packed s | speed-up | padding computed "
        "(padded / packed) | peak RSS GiB (padded / packed) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )
    description = (
        f"{machine_line()}.  Model {args.model} (bench/_common.py), float32, 1 process; 4 "
        f"samples of {PROMPT}-token prompts and R, R/2, R/4, R/8-token responses; median of "
        f"{args.steps} PPO-clip steps after a warm-up, each configuration in a fresh process."
    )
    publish(TITLE, section(TITLE, description, body), args.write)


if __name__ == "__main__":
    main()
