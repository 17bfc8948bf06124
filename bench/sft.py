"""Throughput of the SFT trainer (``trainer: sft``) against the floor of its own engine, at
25M parameters and the Qwen2.5-0.5B shape.

Every row is ``recipes/sft.yaml`` (FSDP, 2 processes x 1 thread, its engine settings:
micro_batch_size 32, grad_clip 1.0) with only the model, the data, the dtype and the step
count changed: 1 warm-up + 3 measured steps, no validation, checkpoint or export.  The batch
is 32 synthetic chat examples (one user turn, one assistant reply: ``reverse <digits>:`` and
the digits reversed, :func:`hf_testing.tasks.make_digit_demonstrations` in ``messages``
form), 30-126 digits each, so 64-256 tokens an example (the tiny tokenizer writes a digit as
one token), about 5,200 tokens a step, half of them trained on.  Models: the 25M Qwen2 of
``bench/_common.py`` (vocabulary 1,024) and the full Qwen2.5-0.5B shape (random weights, the
real vocabulary of 151,936), each in ``float32`` and ``bfloat16`` parameters.

Per row: the trainer's seconds per step and tokens/s (median of the measured steps'
``perf/step_s`` and ``perf/tokens`` in metrics.jsonl; tokens are prompt + reply, as the
trainer counts them), and the floor's: the same engine, built from the same recipe in two
bare gloo processes (no Ray, no trainer), each calling ``engine.train_step(batch, sft_loss)``
on its half of the same batches (the trainer's loader, seed 0; a step is the slower rank's
time).  ``trainer x`` is the trainer's step over the floor's.  Peak RSS: of each of the
run's Ray worker processes (``VmHWM`` read from /proc while the run lasts -- the trainer's
own ``memory/peak_rss_gib`` is the driver's), the driver's, and of each floor rank.

    python bench/sft.py                       # 25M and 0.5B, float32 and bfloat16
    python bench/sft.py --sizes 25M --dtypes float32
    python bench/sft.py --write               # and update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import (
    add_keep_args,
    bench_model,
    cpu_vector_isa,
    init_engine_rank,
    keep_row,
    kept_rows,
    print_result,
    publish,
    run_ranks,
)
from _common import section as make_section
from e2e_throughput import worker_env

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "sft.yaml"
TITLE = "## SFT trainer throughput against its engine's floor (`bench/sft.py`)"
BATCH, WARMUP = 32, 1
DIGITS = (30, 126)
"""Digits of an example's prompt and of its reply: 2 x digits + 4 tokens an example."""
MAX_LENGTH = 2 * DIGITS[1] + 64
"""``sft.max_length``: no example is dropped (the floor reports the dataset's size)."""
WORKER_TITLE = "WorkerProcess"
"""In the title of the run's worker processes (``ray::WorkerProcess.execute``,
``ray::main_<id>_rank0:WorkerProcess...``); Ray's own processes and idle workers lack it."""
GIB = 2**30


# ------------------------------------------------------------------------------ the data


def write_examples(path: Path, rows: int) -> Path:
    """``rows`` chat examples (``messages``: the user's prompt, the assistant's reply)."""
    from hf_testing.tasks import make_digit_demonstrations

    examples = make_digit_demonstrations("reverse", rows, *DIGITS, seed=0)
    with path.open("w") as fh:
        for e in examples:
            messages = [
                {"role": "user", "content": e["prompt"]},
                {"role": "assistant", "content": e["completion"]},
            ]
            fh.write(json.dumps({"messages": messages}) + "\n")
    return path


def overrides(model: Path, data: Path, out: Path, dtype: str, steps: int) -> list[str]:
    """The recipe's changes for one row (the floor loads the recipe with the same)."""
    rows = [
        f"model.path={model}",
        f"data.train_files=[{data}]",
        "data.val_files=[]",
        f"data.batch_size={BATCH}",
        f"run.output_dir={out}",
        f"run.total_steps={steps}",
        "run.seed=0",
        "run.val_every=0",
        "run.save_every=0",
        "run.save_final=false",
        "run.export_final=false",
        "run.progress=false",
        "run.torch_threads=1",
        f"sft.max_length={MAX_LENGTH}",
    ]
    if dtype != "float32":
        rows.append(f"actor.engine.param_dtype={dtype}")
    return rows


# --------------------------------------------------------------------------- the trainer


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry))
    return tree


def _title_and_peak(pid: int) -> tuple[str, float] | None:
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return title, int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


class PeakSampler(threading.Thread):
    """The peak RSS (``VmHWM``) of every process under ``root``, read twice a second while
    it runs: the largest seen per process, with its title."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.peaks: dict[int, float] = {}
        self.titles: dict[int, set[str]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            tree = _children()
            todo = [self.root]
            while todo:
                pid = todo.pop()
                todo += tree.get(pid, [])
                seen = _title_and_peak(pid)
                if seen is not None:
                    self.titles.setdefault(pid, set()).add(seen[0])
                    self.peaks[pid] = max(seen[1], self.peaks.get(pid, 0.0))

    def workers(self) -> list[float]:
        """The peaks (GiB) of the processes ever titled as a trained worker, by process id."""
        return [
            peak
            for pid, peak in sorted(self.peaks.items())
            if any(WORKER_TITLE in t for t in self.titles[pid])
        ]


def run_trainer(args: list[str], out: Path) -> tuple[list[dict], list[float], str]:
    """``hybridflow run recipes/sft.yaml`` in a child: metrics rows, the trained workers'
    peak RSS (GiB) and the run's log."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_DEDUP_LOGS="0")
    cmd = [sys.executable, "-m", "hf_core.cli", "run", str(RECIPE), *args]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        sampler = PeakSampler(proc.pid)
        sampler.start()
        try:
            code = proc.wait(timeout=7200)
        finally:
            sampler.done.set()
            sampler.join()
        log.seek(0)
        text = log.read()
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{text[-4000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, sampler.workers(), text


# ----------------------------------------------------------------------------- the floor


def floor_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> dict:
    """One rank of the floor: the recipe's actor engine, bare, on its half of each batch."""
    init_engine_rank(rank, world, port)
    from transformers import AutoTokenizer

    from hf_core.config import TrainerConfig, load_config
    from hf_core.config.layout import resolve_layout
    from hf_core.data import PromptLoader
    from hf_core.data.chat_tokens import SFTDataset
    from hf_core.device import peak_rss_gib
    from hf_core.roles.common import build_training_engine
    from hf_core.roles.losses import sft_loss
    from hf_core.trainer.batches import token_count

    config = load_config(TrainerConfig, RECIPE, args.overrides)
    layout = resolve_layout(config)
    tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer_path), local_files_only=True)
    files = [str(p) for p in config.data.train_files]
    dataset = SFTDataset.from_files(files, tokenizer, max_length=config.sft.max_length)
    loader = PromptLoader(  # as the trainer reads it (hf_core.trainer.one_model)
        dataset,
        config.data.batch_size,
        shuffle=config.data.shuffle,
        seed=config.run.seed,
        num_epochs=config.data.num_epochs,
    )
    engine = build_training_engine(
        config.actor, config, layout.role("actor"), head="lm", trainable=True
    )
    seconds, tokens, nll = [], [], []
    for step in range(config.run.total_steps):
        batch = next(loader)
        batch.meta["step"] = step
        batch.meta["temperature"] = 1.0  # as ActorRolloutRefWorker.sft_step sets it
        mine = batch.chunk(world)[rank]
        began = time.perf_counter()
        metrics = engine.train_step(mine, sft_loss)
        seconds.append(time.perf_counter() - began)
        tokens.append(token_count(batch))
        nll.append(metrics["sft_nll_sum"] / max(metrics["sft_tokens_sum"], 1.0))
    fit = getattr(engine, "fit", None)
    return {
        "step_s": seconds,
        "tokens": tokens,
        "sft_nll": nll,
        "examples": len(dataset),
        "peak_rss_gib": peak_rss_gib(),
        "strategy": engine.data_parallel_strategy(),
        "max_tokens": None if fit is None else fit.max_tokens,
        "checkpointing": None if fit is None else fit.gradient_checkpointing,
    }


def measure_floor(run_args: list[str]) -> dict[int, dict]:
    """Each floor rank's result (two processes, the workers' environment)."""
    cmd = [sys.executable, __file__, "--child-floor", "--", *run_args]
    env = worker_env(threads=1)  # as the run's workers get it
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"floor failed:\n{done.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(lines[-1][len("RESULT ") :]).items()}


# ------------------------------------------------------------------------------- the rows


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def measure_row(
    size: str, dtype: str, steps: int, rounds: int, work: Path, data: Path
) -> dict[str, Any]:
    """``rounds`` x (the trainer, then the floor), the measured steps of every round pooled:
    on a shared machine a burst of someone else's load then falls on both sides."""
    model = bench_model(size, dtype)
    trainer: list[dict] = []
    floor: list[dict] = []
    for n in range(rounds):
        out = work / f"{size}-{dtype}-{n}"
        args = overrides(model, data, out, dtype, WARMUP + steps)
        began = time.perf_counter()
        rows, workers, _ = run_trainer(args, out)
        trainer.append({"rows": rows, "workers": workers, "wall_s": time.perf_counter() - began})
        trainer[-1]["load_1min"] = os.getloadavg()[0]
        began = time.perf_counter()
        ranks = measure_floor(args)
        floor.append({"ranks": ranks, "wall_s": time.perf_counter() - began})
        floor[-1]["load_1min"] = os.getloadavg()[0]
    measured = [r for t in trainer for r in t["rows"] if r["step"] > WARMUP]
    step_s = median_of(measured, "perf/step_s")
    tokens = median_of(measured, "perf/tokens")
    loop_s = statistics.median(
        b - a
        for t in trainer
        for a, b in list(itertools.pairwise(float(r["timestamp"]) for r in t["rows"]))[WARMUP - 1 :]
    )
    floor_steps = [  # a step of the floor: its slower rank's
        [max(r["step_s"][i] for r in f["ranks"].values()) for i in range(WARMUP + steps)]
        for f in floor
    ]
    floor_s = statistics.median(s for per_step in floor_steps for s in per_step[WARMUP:])
    rank0 = floor[0]["ranks"][0]
    floor_tokens = statistics.median(rank0["tokens"][WARMUP:])
    last = trainer[0]["rows"][-1]
    return {
        "params": parameter_count(model),
        "step_s": step_s,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s,
        "steps_s": [[r["perf/step_s"] for r in t["rows"]] for t in trainer],
        "loop_s": loop_s,
        "worker_peak_rss_gib": [
            max(p) for p in zip(*(t["workers"] for t in trainer), strict=False)
        ],
        "driver_peak_rss_gib": max(
            float(r.get("memory/peak_rss_gib", 0.0)) for t in trainer for r in t["rows"]
        ),
        "sft_nll": [r.get("actor/sft_nll") for r in trainer[0]["rows"]],
        "strategy": sorted(k.split("/")[-1] for k in last if k.startswith("actor/data_parallel/")),
        "fit": [
            last.get("actor/fit/micro_batch_tokens"),
            last.get("actor/fit/gradient_checkpointing"),
        ],
        "wall_s": [t["wall_s"] for t in trainer],
        "floor_s": floor_s,
        "floor_steps_s": floor_steps,
        "floor_tokens": floor_tokens,
        "floor_tokens_per_s": floor_tokens / floor_s,
        "floor_peak_rss_gib": [
            max(f["ranks"][r]["peak_rss_gib"] for f in floor) for r in sorted(floor[0]["ranks"])
        ],
        "floor_strategy": rank0["strategy"],
        "floor_fit": [rank0["max_tokens"], rank0["checkpointing"]],
        "floor_sft_nll": rank0["sft_nll"],
        "examples": rank0["examples"],
        "same_batches": [r["perf/tokens"] for r in trainer[0]["rows"]] == rank0["tokens"],
        "floor_wall_s": [f["wall_s"] for f in floor],
        "ratio": step_s / floor_s,
        "best_ratio": min(float(r["perf/step_s"]) for r in measured)
        / min(s for per_step in floor_steps for s in per_step[WARMUP:]),
        "rounds": rounds,
        "cpu": cpu_vector_isa().strip(" ()") or None,
        # 1-minute load after each trainer and floor run (2 cores: above 2 is contention)
        "load_1min": [
            [t["load_1min"], f["load_1min"]] for t, f in zip(trainer, floor, strict=True)
        ],
    }


def parameter_count(model: Path) -> int:
    from hf_core.planner.models import load_model

    return load_model(model).num_params


def table(results: dict[tuple[str, ...], dict[str, Any]]) -> str:
    head = (
        "| model | params | dtype | tokens/step | trainer s/step | loop s/step | trainer tokens/s "
        "| floor s/step "
        "| floor tokens/s | trainer x | x best | worker peak RSS GiB | driver peak RSS GiB "
        "| floor peak RSS GiB | engine: trainer / floor |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )

    def gib(values: list[float]) -> str:
        return " / ".join(f"{v:.2f}" for v in values) or "-"

    def engine(strategy: str, tokens: Any, checkpointing: Any) -> str:
        """The data-parallel strategy and the micro-batch fit the first update chose."""
        tokens = "-" if tokens is None else f"{int(tokens)} tokens"
        return f"{strategy}, {tokens}{', recompute' if checkpointing else ''}"

    lines = []
    for (size, dtype), r in results.items():
        lines.append(
            f"| {size} | {r['params'] / 1e6:.1f}M | {dtype} | {r['tokens']:,.0f} "
            f"| {r['step_s']:.3f} | {r['loop_s']:.3f} "
            f"| {r['tokens_per_s']:,.0f} | {r['floor_s']:.3f} | {r['floor_tokens_per_s']:,.0f} "
            f"| {r['ratio']:.2f} | {r['best_ratio']:.2f} | {gib(r['worker_peak_rss_gib'])} "
            f"| {r['driver_peak_rss_gib']:.2f} | {gib(r['floor_peak_rss_gib'])} "
            f"| {engine(','.join(r['strategy']), *r['fit'])} "
            f"/ {engine(r['floor_strategy'], *r['floor_fit'])} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25M,0.5B", help="bench_model sizes (_common.py)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up")
    parser.add_argument(
        "--rounds", type=int, default=1, help="trainer-then-floor runs a row, steps pooled"
    )
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    add_keep_args(parser)
    parser.add_argument("--reading", default="", help="a line under the table saying what it shows")
    parser.add_argument("--child-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_floor:
        print_result(run_ranks(floor_rank, 2, args))
        return
    results = kept_rows(args.keep)
    runs = (
        []
        if args.table_only
        else [(s, d) for s in args.sizes.split(",") for d in args.dtypes.split(",")]
    )
    with tempfile.TemporaryDirectory(prefix="hf-sft-bench-") as tmp:
        work = Path(tmp)
        data = write_examples(work / "sft.jsonl", rows=BATCH * 8)
        for size, dtype in runs:
            print(f"{size} {dtype} ...", flush=True)
            try:
                results[(size, dtype)] = row = measure_row(
                    size, dtype, args.steps, args.rounds, work, data
                )
            except RuntimeError as exc:
                print(f"  failed: {exc}", flush=True)
                continue
            print(f"  {json.dumps(row)}", flush=True)
            keep_row(args.keep, (size, dtype), row)
    body = table(results)
    if results:
        ratios = [r["ratio"] for r in results.values()]
        body += (
            f"\nThe trainer's step is {min(ratios):.2f}-{max(ratios):.2f} x the bare engine's "
            "on the same batches."
        )
    if args.reading:
        body += f" {args.reading}"
    body += "\n"
    description = (
        f"`trainer: sft` from recipes/sft.yaml (FSDP, 2 processes x 1 thread), {BATCH} chat "
        f"examples a step of {2 * DIGITS[0] + 4}-{2 * DIGITS[1] + 4} tokens (synthetic digit "
        f"reversal), median of {args.steps} steps after {WARMUP} warm-up.  'floor' is the "
        "same FSDP engine built from the same recipe in two bare gloo processes calling "
        "`train_step(half batch, sft_loss)` on the same batches; 'trainer x' is the "
        "trainer's step over the floor's.  Tokens are prompt + reply.  Worker and floor peak "
        "RSS: each process's VmHWM."
    )
    publish(TITLE, make_section(TITLE, description, body), args.write)


if __name__ == "__main__":
    main()
