"""Where an FSDP actor update's time goes, per op: 1 process x 2 threads against 2 x 1.

Builds the FSDP engine with default settings on a real shape (``hf_testing.real_shapes``) or
the 25M bench model, trains twice on a GRPO-sized batch (warm-up: optimiser state appears,
the micro-batch fit is made), then profiles one ``train_step`` with ``torch.profiler`` and
prints, for rank 0: the step's seconds, its share in collectives, the optimiser step, the
LM head / loss and the rest, and the top ops by self CPU time.

    python bench/profile_update.py --shape 0.5B --rows 16 --prompt 18 --response 32
    python bench/profile_update.py --shape 25M --layouts 1x2,2x1 --shared-prefix off
    python bench/profile_update.py --shape 25M --layouts 2x1 --data-parallel fsdp
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from _common import bench_model, init_engine_rank, machine_line, print_result, run_ranks

COLLECTIVE = ("c10d::", "gloo:", "nccl:", "record_param_comms", "all_gather", "reduce_scatter",
              "allreduce", "all_reduce")  # fmt: skip
OPTIMIZER = ("Optimizer.step", "_multi_tensor_adam", "_single_tensor_adam", "_fused_adam",
             "foreach")  # fmt: skip


def profile_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    init_engine_rank(rank, world, port)
    torch.set_num_threads(args.threads)
    from hf_fsdp.engine import FSDPEngine
    from hf_testing.workers import policy_loss, rollout_batch

    path = bench_model(args.shape)
    engine = FSDPEngine(
        {
            "model_path": str(path),
            "lr": 1e-6,
            "shared_prefix": args.shared_prefix == "on",
            "cpu_data_parallel": args.data_parallel,
        }
    )
    vocab = engine.model.config.vocab_size
    batch = rollout_batch(
        args.rows, args.prompt, args.response, vocab, seed=1, group_size=args.group
    )
    mine = batch.chunk(world)[rank]
    for _ in range(2):
        engine.train_step(mine, policy_loss)
    began = time.perf_counter()
    engine.train_step(mine, policy_loss)
    plain_s = time.perf_counter() - began
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.train_step(mine, policy_loss)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6

    def share(names: tuple[str, ...]) -> float:
        return sum(e.self_cpu_time_total for e in events if any(n in e.key for n in names)) / 1e6

    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]
    return {
        "step_s": plain_s,
        "profiled_self_s": total,
        "collectives_s": share(COLLECTIVE),
        "optimizer_s": share(OPTIMIZER),
        "top": [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", default="0.5B", help="a bench model: 0.85M, 25M, 0.5B-2layers, 0.5B"
    )
    parser.add_argument("--rows", type=int, default=16, help="samples in the step (all ranks)")
    parser.add_argument("--prompt", type=int, default=18)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO's n)")
    parser.add_argument(
        "--shared-prefix", default="on", choices=("on", "off"), help="the engine's shared_prefix"
    )
    parser.add_argument(
        "--data-parallel",
        default="auto",
        choices=("auto", "leader", "replicate", "fsdp"),
        help="the engine's cpu_data_parallel (auto and fsdp: FSDP2 shards on several "
        "processes, auto a plain module on one; leader; replicate)",
    )
    parser.add_argument("--layouts", default="1x2,2x1", help="processes x threads, comma-separated")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from hf_core.runtime.process_env import worker_process_env

    os.environ.update(worker_process_env())  # as the trainer's workers run (huge pages)
    print(machine_line())
    bench_model(args.shape)  # built once here, not by every rank at once
    for layout in args.layouts.split(","):
        processes, threads = (int(x) for x in layout.split("x"))
        args.threads = threads
        ranks = run_ranks(profile_rank, processes, args)
        r = ranks[0]
        print(f"\n{args.shape}, {args.rows} x ({args.prompt} + {args.response}) tokens, "
              f"{processes} process(es) x {threads} thread(s)")  # fmt: skip
        print(f"step {r['step_s']:.2f} s (slowest rank "
              f"{max(x['step_s'] for x in ranks.values()):.2f} s); profiled self time "
              f"{r['profiled_self_s']:.2f} s: collectives {r['collectives_s']:.2f} s, "
              f"optimizer {r['optimizer_s']:.2f} s")  # fmt: skip
        for key, count, seconds in r["top"]:
            print(f"  {seconds:8.3f} s  {count:6d}  {key}")
        print_result({"layout": layout, **{k: v for k, v in r.items() if k != "top"}})
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()
