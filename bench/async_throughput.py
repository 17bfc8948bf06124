"""Asynchronous RL modes against the synchronous loop on the same 1 + 1 process placement.

GRPO with the tiny Qwen2 of ``bench/e2e_throughput.py`` (transformers rollout, FSDP actor) on
``placement.mode: standalone``: one actor process and one rollout process, one torch thread
each.  The modes, same seed and data:

- ``sync``: ``rollout.max_staleness: 0`` -- generate, then train, then sync; each process
  waits for the other.
- ``batch k=1``: whole batches one step ahead; a batch is trained when its slowest sample ends.
- ``streaming``: ``rollout.mode: streaming`` with ``max_staleness: 1`` and
  ``partial_rollouts: false`` -- groups handed over as they finish, continuous batching, an
  update waits for the responses under way.
- ``streaming + partial``: the same with new weights reaching responses under way.

Workloads: ``small`` and ``large`` are ``bench/e2e_throughput.py``'s configurations (responses
run to ``max_new_tokens``: the untrained model rarely samples its EOS); ``longtail`` has 64
prompts x 4 samples and up to 256 new tokens with 20 stop tokens (``LONGTAIL_STOPS``), so
response lengths are long-tailed: on the untrained model a median of about 34 tokens, a 90th
percentile of about 115, and some run to the cap -- a batch's slowest sample holds its batch.
``uniform`` is the opposite case: 64 prompts x 4 samples, 64 new tokens and no stop token, so
every response runs to the cap (``large``'s shape, named for what it tests): no long tail for
streaming to win back, only its own costs (the pauses for weights, the prefixes recomputed
after each update) against batch k=1.

The modes alternate within each of ``--rounds`` rounds (this machine's speed drifts by tens
of percent over minutes, so one run of each would compare different machines): per mode the
median seconds per step over every round's steps after the warm-up, tokens/s (prompt +
response tokens per second of step wall time), the ratio per round against ``sync`` and
``batch k=1``, the trainer's idle fraction (its wait for samples over the step time), the
pool's idle fraction (streaming), and mean staleness / version spread.

    python bench/async_throughput.py --configs longtail        # print the table
    python bench/async_throughput.py --configs uniform --modes "batch k=1,streaming + partial"
    python bench/async_throughput.py --configs longtail --write  # also update RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _common import bench_model, publish, section
from e2e_throughput import CONFIGS, recipe_overrides, run_trainer, write_task

TITLE = "## Asynchronous RL modes vs the synchronous loop (`bench/async_throughput.py`)"
LONGTAIL_STOPS = list(range(100, 120))
"""Stop tokens of the long-tailed workload: about 2% of the untrained model's mass each step."""
WORKLOADS = {**CONFIGS, "uniform": (64, 4, 64), "longtail": (64, 4, 256)}
WORKLOAD_EXTRA = {"longtail": [f"rollout.stop_token_ids=[{','.join(map(str, LONGTAIL_STOPS))}]"]}
MODES: dict[str, list[str]] = {
    "sync": ["rollout.max_staleness=0"],
    "batch k=1": ["rollout.max_staleness=1"],
    "streaming": [
        "rollout.max_staleness=1",
        "rollout.mode=streaming",
        "rollout.partial_rollouts=false",
    ],
    "streaming + partial": ["rollout.max_staleness=1", "rollout.mode=streaming"],
}


def run(
    model: Path, data: Path, out: Path, config: str, mode: str, args: argparse.Namespace
) -> list[dict]:
    """The metrics rows after the warm-up of one run."""
    base = "large" if config in ("longtail", "uniform") else config
    overrides = recipe_overrides(model, data, out, base, (1, 1), args.steps)
    _, _, new_tokens = WORKLOADS[config]
    overrides += [
        f"rollout.max_new_tokens={new_tokens}",
        "placement.mode=standalone",
        "placement.rollout_processes=1",
        *WORKLOAD_EXTRA.get(config, []),
        *MODES[mode],
    ]
    run_trainer(None, overrides, out, args.warmup)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[args.warmup :]


def summary(rows: list[dict]) -> dict:
    step = statistics.median(r["perf/step_s"] for r in rows)

    def mean(key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return statistics.mean(values) if values else None

    idle = [r["timing/generate"] / r["perf/step_s"] for r in rows]
    return {
        "step_s": step,
        "tokens_per_s": statistics.median(r["perf/tokens"] for r in rows) / step,
        "trainer_idle": statistics.mean(idle),
        "pool_idle": mean("stream/pool_idle_frac"),
        "staleness": mean("async/staleness") or 0.0,
        "spread": mean("stream/version_spread_mean"),
        "interrupted": mean("stream/interrupted_samples"),
        "dropped": rows[-1].get("async/dropped_samples", 0.0),
        "response": mean("response_length/mean"),
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict, rounds: dict, configs: list[str]) -> str:
    lines = [
        "| config | mode | s/step | tokens/s | trainer idle | pool idle | mean staleness "
        "| version spread | interrupted / step | dropped | mean response |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (config, mode), res in results.items():
        lines.append(
            f"| {config} | {mode} | {res['step_s']:.3f} | {res['tokens_per_s']:,.0f} "
            f"| {res['trainer_idle']:.2f} | {_fmt(res['pool_idle'])} | {res['staleness']:.2f} "
            f"| {_fmt(res['spread'])} | {_fmt(res['interrupted'], 1)} | {res['dropped']:.0f} "
            f"| {_fmt(res['response'], 1)} |"
        )
    lines.append("")
    for config in configs:
        for mode in MODES:
            if mode == "sync" or (config, mode) not in results:
                continue
            for against in ("sync", "batch k=1"):
                if against == mode or (config, against) not in results:
                    continue
                ratio = (
                    results[config, mode]["tokens_per_s"] / results[config, against]["tokens_per_s"]
                )
                per_round = ", ".join(
                    f"{r[mode] / r[against]:.2f}x" for r in rounds[config] if against in r
                )
                lines.append(
                    f"- {config}: {mode} / {against} tokens/s = {ratio:.2f}x "
                    f"(per round: {per_round})"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="longtail")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every mode")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    configs = args.configs.split(",")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {list(MODES)}")

    results: dict[tuple[str, str], dict] = {}
    rounds: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="hf-async-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = bench_model("0.85M")
        data = write_task(tmp / "train.jsonl", rows=4096)
        for config in configs:
            rows: dict[str, list[dict]] = {mode: [] for mode in modes}
            for i in range(args.rounds):
                speed: dict[str, float] = {}
                for mode in modes:
                    out = tmp / f"{config}-{mode.replace(' ', '_').replace('+', 'p')}-r{i}"
                    rows[mode] += (got := run(model, data, out, config, mode, args))
                    this_run = summary(got)
                    speed[mode] = this_run["tokens_per_s"]
                    print(config, mode, i, json.dumps(this_run), flush=True)
                rounds.setdefault(config, []).append(speed)
            for mode in modes:
                results[config, mode] = summary(rows[mode])

    workloads = ", ".join(
        f"{c}: {p} prompts x {n} samples, up to {t} new tokens"
        for c, (p, n, t) in WORKLOADS.items()
        if c in configs
    )
    description = (
        "GRPO steps of `hybridflow run` on `placement.mode: standalone` with one actor "
        "process and one rollout process (one torch thread each), the tiny Qwen2 (0.85M) of "
        f"`bench/e2e_throughput.py` ({workloads}; longtail: 20 stop tokens). Modes: sync "
        "(`max_staleness: 0`), batch k=1 (`max_staleness: 1`), streaming (`rollout.mode: "
        "streaming`, `max_staleness: 1`, `partial_rollouts: false`), streaming + partial "
        f"(the same with partial rollouts). {args.rounds} rounds, each running every mode in "
        f"turn; per mode the median over all rounds of the {args.steps - args.warmup} steps "
        f"after {args.warmup} warm-up steps; tokens/s = prompt + response tokens per second "
        "of step wall time; trainer idle = the trainer's wait for samples / step time; pool "
        "idle = the rollout thread's time with nothing to decode or paused / its time."
    )
    text = section(TITLE, description, table(results, rounds, configs))
    publish(TITLE, text, args.write)


if __name__ == "__main__":
    main()
