"""Long responses: step time and peak memory of a policy update, packed against padded.

One FSDP training engine (1 process, float32, the default engine settings but
``sequence_packing``) takes PPO-clip steps on a mixed-length batch: 4 samples with 64-token
prompts and responses of R, R/2, R/4 and R/8 tokens, for each R in ``--lengths``.  Padded,
every sample is computed at the longest one's width; packed
(:mod:`hf_core.engines.sequence_packing`), the samples run back to back in one row with a
document mask, and the engine's ``padding_tokens_sum`` counter says how many padding tokens
were computed.  Each measurement runs in a fresh process (peak RSS is that process's); the
time is the median of ``--steps`` steps after one warm-up step.

``--sequence-parallel`` measures Ulysses sequence parallelism instead (:mod:`hf_fsdp.ulysses`):
the actor's work in one GRPO step (old log-probs, then the update) on a group of 2 samples of
one 64-token prompt with R and R/2 response tokens, on one process (SP=1, both cores) against
two processes splitting every sequence (SP=2, one core each), each in fresh processes.  It
reports each rank's peak RSS and its growth over the loaded engine (what the step itself
adds: activations, logits, gathered outputs), the largest over the ranks, and the step time;
the engine runs its defaults otherwise.

    python bench/long_context.py [--lengths 1024,2048,4096] [--model 0.85M] [--write]
    python bench/long_context.py --sequence-parallel [--lengths 2048,8192,16384,32768] [--write]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

from _common import (
    bench_model,
    init_gloo,
    machine_line,
    pin_mmap_threshold,
    print_result,
    publish,
    run_child,
    run_ranks,
    section,
)

TITLE = "## Long responses: packed against padded updates (`bench/long_context.py`)"
SP_TITLE = (
    "## Long responses: Ulysses sequence parallelism, model {model} "
    "(`bench/long_context.py --sequence-parallel`)"
)
SP_SHARES = (1, 2)  # one prompt's group: responses of R and R/2 tokens
PROMPT = 64
SHARES = (1, 2, 4, 8)  # the batch's responses: R, R/2, R/4, R/8 tokens
GIB = 2**30


def long_batch(response: int, vocab: int, shares: tuple[int, ...] = SHARES):
    """The mixed-length batch: full prompts, responses right-padded to ``response``."""
    import torch

    from hf_core.batch import Batch
    from hf_core.engines import assemble_rollout

    gen = torch.Generator().manual_seed(0)
    rows = len(shares)
    prompts = Batch(
        {
            "input_ids": torch.randint(3, vocab, (rows, PROMPT), generator=gen),
            "attention_mask": torch.ones(rows, PROMPT, dtype=torch.long),
        }
    )
    lengths = torch.tensor([response // share for share in shares])
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


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sequence_parallel_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> dict:
    """One rank of an SP=``world`` group: the GRPO step's actor work on the whole group."""
    import torch
    from transformers import AutoConfig

    from hf_fsdp.engine import FSDPEngine
    from hf_testing.workers import policy_loss

    init_gloo(rank, world, port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    path = bench_model(args.model)
    batch = long_batch(args.response, AutoConfig.from_pretrained(path).vocab_size, SP_SHARES)
    engine = FSDPEngine(
        {
            "model_path": str(path),
            "lr": 1e-5,
            "sequence_parallel_size": world,
            "micro_batch_size": 1,  # both sides hold the same sequence at once
            "gradient_checkpointing": args.recompute,
        }
    )
    loaded = _resident_bytes()
    seconds = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        batch["old_log_probs"] = engine.compute_log_probs(batch)["log_probs"]
        metrics = engine.train_step(batch, policy_loss)
        seconds.append(time.perf_counter() - begin)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "seconds": statistics.median(seconds),
        "peak": peak,
        "growth": peak - loaded,
        "checkpointing": metrics.get("fit/gradient_checkpointing", 0.0),
        "tokens": int(batch["attention_mask"].sum()),
    }


def sequence_parallel_rows(args: argparse.Namespace) -> list[str]:
    rows = []
    for response in (int(x) for x in args.lengths.split(",")):
        args.response = response
        one = run_ranks(sequence_parallel_rank, 1, args)[0]
        two = run_ranks(sequence_parallel_rank, 2, args)
        peak2 = max(r["peak"] for r in two.values())
        growth2 = max(r["growth"] for r in two.values())
        seconds2 = max(r["seconds"] for r in two.values())
        rows.append(
            f"| {response:,} | {one['tokens']:,} | {one['seconds']:.2f} | {seconds2:.2f} "
            f"| {one['peak'] / GIB:.2f} / {peak2 / GIB:.2f} "
            f"| {one['growth'] / GIB:.2f} / {growth2 / GIB:.2f} "
            f"| {1 - growth2 / one['growth']:.0%} "
            f"| {'on' if one['checkpointing'] else 'off'} / "
            f"{'on' if two[0]['checkpointing'] else 'off'} |"
        )
        print(rows[-1], flush=True)
    return rows


def measure(model: str, response: int, packed: bool, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(response), "--model", model]
    cmd += ["--steps", str(steps), "--packed" if packed else "--padded"]
    return run_child(cmd, dict(os.environ), f"R={response} packed={packed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=None, help="longest responses R")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="SP=1 against SP=2 (Ulysses)"
    )
    parser.add_argument(
        "--recompute",
        default="false",
        choices=["false", "true", "auto"],
        help="--sequence-parallel: gradient_checkpointing on both sides (false: activations "
        "kept, what SP divides)",
    )
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
    if args.sequence_parallel:
        pin_mmap_threshold()  # freed tensors leave RSS at once: the peak is the live tensors
        args.recompute = {"false": False, "true": True}.get(args.recompute, "auto")
        args.lengths = args.lengths or "2048,8192,16384,32768"
        rows = sequence_parallel_rows(args)
        body = (
            "| R | tokens | SP=1 s | SP=2 s | peak RSS GiB (SP=1 / SP=2, per rank) "
            "| step growth GiB (SP=1 / SP=2) | growth saved | recompute (SP=1 / SP=2) |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
        )
        description = (
            f"{machine_line()}.  Model {args.model} (bench/_common.py), float32; a GRPO "
            f"group of 2 samples of one {PROMPT}-token prompt with R and R/2-token "
            "responses; old log-probs then one PPO-clip update (median of "
            f"{args.steps}), SP=1 on 1 process with every core, SP=2 on 2 processes with "
            "one core each, fresh processes per row; one sample per micro-batch "
            "(micro_batch_size: 1, so both sides hold the same sequence at once), "
            f"gradient_checkpointing: {args.recompute}, engine defaults otherwise.  Step "
            "growth: peak RSS minus RSS once the engine is loaded, the largest over the "
            "ranks (glibc's mmap threshold pinned at 64 KiB, so freed tensors leave RSS and "
            "the peak is the live tensors')."
        )
        title = SP_TITLE.format(model=args.model)
        publish(title, section(title, description, body), args.write)
        return
    args.lengths = args.lengths or "1024,2048,4096"
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
