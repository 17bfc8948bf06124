"""Asynchronous RL against its synchronous twin on the same 1 + 1 process placement.

The workload of ``bench/e2e_throughput.py`` (tiny Qwen2, GRPO, HF rollout, FSDP actor, its
``small`` and ``large`` configurations), on ``placement.mode: standalone``: one actor process
and one rollout process, one torch thread each.  The twin runs with ``rollout.max_staleness:
0`` (generate, then train, then sync: each process waits for the other); the asynchronous run
with ``max_staleness: 1`` (the rollout process generates the next batch while the actor
trains).  Same seed, same data, measured in one run, the twins alternating over ``--rounds``
rounds (this machine's speed drifts by tens of percent over minutes, so one run of each would
compare different machines): per twin the median seconds per step over every round's steps
after the warm-up, tokens/s (prompt + response tokens per second of step wall time), the
ratio per round and overall, and the mean staleness and importance weight of the
asynchronous run.

    python bench/async_throughput.py                  # print the table
    python bench/async_throughput.py --write          # also update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _common import bench_model, publish, section
from e2e_throughput import CONFIGS, recipe_overrides, run_trainer, write_task

TITLE = "## Asynchronous RL vs its synchronous twin (`bench/async_throughput.py`)"
TWINS = {"sync (max_staleness 0)": 0, "async (max_staleness 1)": 1}


def run(
    model: Path, data: Path, out: Path, config: str, staleness: int, args: argparse.Namespace
) -> list[dict]:
    """The metrics rows after the warm-up of one run."""
    overrides = recipe_overrides(model, data, out, config, (1, 1), args.steps)
    overrides += [
        "placement.mode=standalone",
        "placement.rollout_processes=1",
        f"rollout.max_staleness={staleness}",
    ]
    run_trainer(None, overrides, out, args.warmup)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[args.warmup :]


def summary(rows: list[dict]) -> dict:
    step = statistics.median(r["perf/step_s"] for r in rows)
    weights = [r["actor/is_weight_mean"] for r in rows if "actor/is_weight_mean" in r]
    return {
        "step_s": step,
        "tokens_per_s": statistics.median(r["perf/tokens"] for r in rows) / step,
        "staleness": statistics.mean(r.get("async/staleness", 0.0) for r in rows),
        "is_weight": statistics.mean(weights) if weights else None,
    }


def table(results: dict, rounds: dict) -> str:
    lines = [
        "| config | loop | s/step | tokens/s | mean staleness | mean IS weight |",
        "|---|---|---|---|---|---|",
    ]
    for (config, twin), res in results.items():
        weight = "-" if res["is_weight"] is None else f"{res['is_weight']:.3f}"
        lines.append(
            f"| {config} | {twin} | {res['step_s']:.3f} | {res['tokens_per_s']:,.0f} "
            f"| {res['staleness']:.2f} | {weight} |"
        )
    lines.append("")
    for config in CONFIGS:
        pair = [results.get((config, twin)) for twin in TWINS]
        if all(pair):
            sync, asynchronous = pair
            ratio = asynchronous["tokens_per_s"] / sync["tokens_per_s"]
            per_round = ", ".join(f"{r:.2f}x" for r in rounds[config])
            lines.append(
                f"- {config}: async / sync tokens/s = {ratio:.2f}x (per round: {per_round})"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="small,large")
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="sync/async pairs per config")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()

    results: dict[tuple[str, str], dict] = {}
    rounds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="hf-async-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = bench_model("0.85M")
        data = write_task(tmp / "train.jsonl", rows=4096)
        for config in args.configs.split(","):
            rows: dict[str, list[dict]] = {twin: [] for twin in TWINS}
            for i in range(args.rounds):
                speed = {}
                for twin, staleness in TWINS.items():
                    out = tmp / f"{config}-k{staleness}-r{i}"
                    rows[twin] += (got := run(model, data, out, config, staleness, args))
                    this_run = summary(got)
                    speed[twin] = this_run["tokens_per_s"]
                    print(config, twin, i, json.dumps(this_run), flush=True)
                sync_speed, async_speed = speed.values()
                rounds.setdefault(config, []).append(async_speed / sync_speed)
            for twin in TWINS:
                results[config, twin] = summary(rows[twin])

    prompts = ", ".join(
        f"{c}: {p} prompts x {n} samples, {t} new tokens"
        for c, (p, n, t) in CONFIGS.items()
        if c in args.configs.split(",")
    )
    description = (
        "GRPO steps of `hybridflow run` on `placement.mode: standalone` with one actor "
        "process and one rollout process (one torch thread each), the workload of "
        f"`bench/e2e_throughput.py` ({prompts}); the synchronous twin has "
        "`rollout.max_staleness: 0`, the asynchronous run `1` (truncated importance "
        f"weights, cap 2). {args.rounds} rounds, each running the synchronous twin then the "
        f"asynchronous run; per twin the median over all rounds of the "
        f"{args.steps - args.warmup} steps after {args.warmup} warm-up steps; tokens/s = "
        "prompt + response tokens per second of step wall time."
    )
    text = section(TITLE, description, table(results, rounds))
    publish(TITLE, text, args.write)


if __name__ == "__main__":
    main()
