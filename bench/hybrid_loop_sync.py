"""The 3D-HybridEngine inside the running RL loop: per-step weight-sync seconds and bytes,
the paper's plan against the naive one, on the 23.7 M-parameter Qwen2.

``hybridflow run`` trains GRPO with a megatron actor laid out p=2, t=2 on 4 ranks and a
rollout engine of generation TP t_g=2 in the same processes (vLLM by default), once with
``rollout.reshard=hybrid`` and once with ``naive``; everything else is equal.  The numbers
are the trainer's own per-step log (``reshard/*``, ``perf/weight_sync_s``), so what is
measured is what a recipe runs: the transition's all-gathers, the slices' copy into the
rollout engine and its cache flush.

    python bench/hybrid_loop_sync.py [--rollout vllm|megatron] [--steps 5] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import publish, section, training_bench_model
from e2e_throughput import write_task

TITLE = "## 3D-HybridEngine in the RL loop: weight sync per step (`bench/hybrid_loop_sync.py`)"
KEYS = (
    "perf/weight_sync_s",
    "reshard/seconds",
    "reshard/bytes_received",
    "reshard/bytes_expected",
    "reshard/model_bytes",
    "reshard/peak_extra_bytes",
    "reshard/zero_redundancy",
    "perf/step_s",
)
MIB = 2**20


def overrides(model: str, data: Path, out: Path, kind: str, args: argparse.Namespace) -> list:
    engine = ["rollout.engine.kv_cache_bytes=268435456"] if args.rollout == "vllm" else []
    return [
        f"model.path={model}",
        f"data.train_files=[{data}]",
        "data.batch_size=8",
        "data.chat_template=false",
        f"run.output_dir={out}",
        f"run.total_steps={args.steps}",
        "run.progress=false",
        "run.save_final=false",
        "run.torch_threads=1",
        "placement.processes=4",
        "cluster.num_cpus=4",
        f"rollout.backend={args.rollout}",
        "rollout.n=2",
        "rollout.max_new_tokens=8",
        "rollout.tensor_parallel_size=2",
        f"rollout.reshard={kind}",
        *engine,
        "actor.backend=megatron",
        "actor.engine.lr=1e-5",
        "actor.parallel.tp=2",
        "actor.parallel.pp=2",
        "actor.engine.micro_batch_size=4",
        "reward.function=digits_reverse",
        "algorithm.advantage=grpo",
    ]


def run(model: str, data: Path, out: Path, kind: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_DEDUP_LOGS="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text("{}\n")
    cmd = [
        sys.executable,
        "-m",
        "hf_core.cli",
        "run",
        str(recipe),
        *overrides(model, data, out, kind, args),
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = rows[args.warmup :]
    result: dict[str, Any] = {
        key: statistics.median(float(r[key]) for r in measured) for key in KEYS
    }
    result["exact_every_step"] = all(
        r["reshard/bytes_received"] == r["reshard/bytes_expected"] for r in rows
    )
    result["wall_s"] = time.perf_counter() - start
    return result


def table(results: dict[str, dict]) -> str:
    lines = [
        "| plan | sync s / step | transition s | received MiB (max rank) | Table 2 MiB | "
        "= every step | zero redundancy | peak extra MiB | step s |",
        "|---|---:|---:|---:|---:|:---:|:---:|---:|---:|",
    ]
    for kind, r in results.items():
        lines.append(
            f"| {kind} | {r['perf/weight_sync_s']:.3f} | {r['reshard/seconds']:.3f} | "
            f"{r['reshard/bytes_received'] / MIB:.2f} | {r['reshard/bytes_expected'] / MIB:.2f} | "
            f"{'yes' if r['exact_every_step'] else 'NO'} | "
            f"{'yes' if r['reshard/zero_redundancy'] == 1.0 else 'no'} | "
            f"{r['reshard/peak_extra_bytes'] / MIB:.2f} | {r['perf/step_s']:.2f} |"
        )
    hybrid, naive = results.get("hybrid"), results.get("naive")
    if hybrid and naive:

        def ratio(key: str) -> str:
            return f"{naive[key] / max(hybrid[key], 1e-12):.2f}x"

        lines += [
            "",
            f"naive / paper: sync seconds {ratio('perf/weight_sync_s')}, transition seconds "
            f"{ratio('reshard/seconds')}, received bytes {ratio('reshard/bytes_received')}, "
            f"peak extra memory {ratio('reshard/peak_extra_bytes')}.",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollout", default="vllm", choices=("vllm", "megatron"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hf-hybrid-loop-") as tmp_name:
        tmp = Path(tmp_name)
        model = training_bench_model(tmp / "model", args.hidden, args.layers)
        data = write_task(tmp / "train.jsonl", rows=512)
        for kind in ("hybrid", "naive"):
            results[kind] = run(model, data, tmp / kind, kind, args)
            print(kind, json.dumps(results[kind]), flush=True)
    m = results["hybrid"]["reshard/model_bytes"] / MIB
    description = (
        f"GRPO steps of `hybridflow run`: megatron actor p=2, t=2, d=1 on 4 ranks (gloo, "
        f"CPU, 1 thread each) -> {args.rollout} rollout with t_g=2 in the same processes; "
        f"tiny Qwen2 hidden {args.hidden}, {args.layers} layers (23.7 M parameters at the "
        f"defaults), float32, M = {m:.2f} MiB as the all-gathers move it; 8 prompts x 2 "
        f"samples, 8 new tokens. Median of {args.steps - args.warmup} steps after "
        f"{args.warmup} warm-up step(s), from the trainer's own metrics.jsonl. Table 2: "
        "paper (pt - t_g p_g) / (t_g p_g pt) M = M/4 per rank, naive (pt - 1)/pt M = 3M/4. "
        "sync s = the whole sync on the slowest rank; transition s = from the first "
        "all-gather to the last bucket handed over (the rollout engine loads each bucket "
        "in between), without the final cache flush."
    )
    text = section(TITLE, description, table(results))
    publish(TITLE, text, args.write)


if __name__ == "__main__":
    main()
