"""How each cost of a GRPO step grows with the model, from 0.85M parameters to Qwen2.5-0.5B.

Every row is the same GRPO recipe with default engine settings (2 processes x 1 thread,
4 prompts x 4 samples, 32 new tokens, 1 warm-up + 3 measured steps); only the model and the
dtype change between rows.  Models: the e2e bench's 0.85M Qwen2 (vocab 1,024), a 25M Qwen2
(vocab 1,024), the Qwen2.5-0.5B shape with 2 layers (real vocabulary 151,936) and the full
Qwen2.5-0.5B shape (random weights, ``hf_testing.real_shapes``).  Backend pairs: FSDP ->
transformers, FSDP -> vLLM, and megatron TP=2 -> vLLM t_g=2; ``float32`` and ``bfloat16``.  Plus
LoRA on the Qwen2.5-1.5B shape (FSDP -> transformers, bfloat16).

Per row: seconds per stage, tokens/s, peak RSS of each process, weight-sync seconds and the
bytes the plan moves per rank, checkpoint save and restore seconds and bytes (a second run
resumes from the first one's checkpoint), and the step's ratio to its floor: the same
engines, built from the same recipe in two bare gloo processes (no Ray, no trainer), timing
``generate`` of the step's prompts plus one ``train_step`` on the result.

    python bench/scale.py                                  # every row (an hour or more)
    python bench/scale.py --sizes 0.85M,0.5B-2layers --pairs fsdp-transformers --dtypes float32
    python bench/scale.py --write                          # and update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    REAL_SHAPES,
    TINY_SHAPES,
    add_keep_args,
    bench_model,
    cpu_vector_isa,
    grpo_overrides,
    init_engine_rank,
    keep_row,
    kept_rows,
    print_result,
    publish,
    run_ranks,
    section,
)
from e2e_throughput import task_prompts, worker_env, write_task

ROOT = Path(__file__).resolve().parents[1]
TITLE = "## Cost of a GRPO step against model size (`bench/scale.py`)"
LORA_SHAPE = ("1.5B-lora", "qwen2.5-1.5b")
LORA_DTYPE = "bfloat16"
"""In float32 the frozen weights and the transformers engine's copy estimate 10.7 GiB a process,
over the 10.2 GiB budget two processes get on 24 GiB: the pre-start check refuses it."""
PAIRS: dict[str, list[str]] = {
    "fsdp-transformers": ["actor.backend=fsdp", "rollout.backend=transformers"],
    "fsdp-vllm": ["actor.backend=fsdp", "rollout.backend=vllm"],
    "megatron-vllm": [
        "actor.backend=megatron",
        "actor.parallel.tp=2",
        "rollout.backend=vllm",
        "rollout.tensor_parallel_size=2",
    ],
}
DTYPE_KEYS = {  # backend -> its dtype setting
    "fsdp": "actor.engine.param_dtype",
    "megatron": "actor.engine.param_dtype",
    "transformers": "rollout.engine.dtype",
    "vllm": "rollout.engine.dtype",
}
STAGES = ("generate", "prepare", "advantage", "update_actor", "weight_sync")
PROMPTS, SAMPLES, NEW_TOKENS, STEPS, WARMUP = 4, 4, 32, 4, 1
SAVED = re.compile(r"checkpoint of step \d+ saved in ([\d.]+) s \((\d+) bytes\)")
RESTORED = re.compile(r"restored in ([\d.]+) s")
PEAK = re.compile(r"memory/(peak_rss|\w+_peak)_gib")
"""Per-process peak RSS metrics (the largest over ranks): the run's and each stage's."""


def model_folder(size: str, dtype: str) -> Path:
    """The row's model, built once into the cache (real shapes in their dtype)."""
    return bench_model(LORA_SHAPE[1] if size == LORA_SHAPE[0] else size, dtype)


def overrides(model: Path, data: Path, out: Path, pair: str, dtype: str, size: str) -> list[str]:
    actor, rollout = pair.split("-")
    rows = grpo_overrides(
        model,
        data,
        out,
        prompts=PROMPTS,
        samples=SAMPLES,
        new_tokens=NEW_TOKENS,
        steps=STEPS,
        processes=2,
        lr="1e-5",
        extra=["run.torch_threads=1", *PAIRS[pair]],
    )
    if dtype != "float32":
        rows += [f"{DTYPE_KEYS[actor]}={dtype}", f"{DTYPE_KEYS[rollout]}={dtype}"]
    if size == LORA_SHAPE[0]:
        rows += ["actor.engine.lora.rank=16", "actor.engine.lora.alpha=32"]
    return rows


def hybridflow(args: list[str], out: Path, resume: bool = False) -> tuple[list[dict], str]:
    """``hybridflow run`` in a child: the metrics rows and the driver's log."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_DEDUP_LOGS="0")
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text("{}\n")
    cmd = [sys.executable, "-m", "hf_core.cli", "run", str(recipe), *args]
    if resume:
        cmd.append("--resume")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    text = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in text], done.stdout + done.stderr


def median(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if key in r]
    return statistics.median(values) if values else None


def peak_rss(rows: list[dict]) -> float:
    """The largest per-process peak RSS the rows report (GiB)."""
    return max((float(v) for r in rows for k, v in r.items() if PEAK.fullmatch(k)), default=0.0)


def floor_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> dict:
    """One rank of the floor: the run's own engines, bare, on one step's batch."""
    import torch

    init_engine_rank(rank, world, port)
    from hf_core.config import TrainerConfig, load_config
    from hf_core.config.layout import resolve_layout
    from hf_core.plugins import get_rollout_engine
    from hf_core.roles.common import build_training_engine, rollout_engine_args
    from hf_core.trainer.batches import sampling_params
    from hf_testing.workers import policy_loss

    config = load_config(TrainerConfig, None, args.overrides)
    layout = resolve_layout(config)
    actor = build_training_engine(
        config.actor, config, layout.role("actor"), head="lm", trainable=True
    )
    rollout = get_rollout_engine(config.rollout.backend)(
        **rollout_engine_args(config, layout.generation), **config.rollout.engine
    )
    tp = layout.generation.tp
    share = PROMPTS if tp == world else PROMPTS // world
    start = 0 if tp == world else rank * share
    prompts = task_prompts(config.model.path, args.data, start, share)
    params = sampling_params(config.rollout, step=1, seed=0)
    rollout.generate(prompts, params)  # warm-up
    began = time.perf_counter()
    out = rollout.generate(prompts, params)
    generate_s = time.perf_counter() - began
    mask = out["response_mask"].float()
    out["old_log_probs"] = out["rollout_log_probs"] if "rollout_log_probs" in out else 0 * mask
    out["advantages"] = torch.randn(mask.shape[0], 1).expand_as(mask).contiguous()
    rollout.release_memory()  # as the loop's hand-over does before an update
    actor.train_step(out, policy_loss)  # warm-up (optimiser state appears)
    began = time.perf_counter()
    actor.train_step(out, policy_loss)
    return {"generate_s": generate_s, "update_s": time.perf_counter() - began}


def measure_floor(run_args: list[str], data: Path) -> float:
    """Seconds of raw generation + raw update of one step's batch (the slowest rank)."""
    cmd = [sys.executable, __file__, "--child-floor", "--data", str(data), "--", *run_args]
    env = worker_env(threads=1)  # as the run's workers get it
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"floor failed:\n{done.stderr[-4000:]}")
    ranks = json.loads(lines[-1][len("RESULT ") :]).values()
    return max(r["generate_s"] for r in ranks) + max(r["update_s"] for r in ranks)


def measure_row(size: str, pair: str, dtype: str, work: Path, data: Path) -> dict[str, Any]:
    model = model_folder(size, dtype)
    out = work / f"{size}-{pair}-{dtype}"
    args = overrides(model, data, out, pair, dtype, size)
    began = time.perf_counter()
    rows, log = hybridflow(args, out)
    wall = time.perf_counter() - began
    measured = rows[WARMUP:]
    saved = SAVED.findall(log)
    resumed, resume_log = hybridflow([*args, f"run.total_steps={STEPS + 1}"], out, resume=True)
    restored = RESTORED.findall(resume_log)
    step = median(measured, "perf/step_s") or float("nan")
    result: dict[str, Any] = {
        "params": parameter_count(model),
        "step_s": step,
        "tokens_per_s": median(measured, "perf/throughput"),
        "stages": {s: median(measured, f"timing/{s}") for s in STAGES},
        "peak_rss_gib": peak_rss(rows),
        "resumed_peak_rss_gib": peak_rss([r for r in resumed if r["step"] > STEPS]),
        "memory": {k: median(measured, k) for k in measured[-1] if k.startswith("memory/")},
        "sync": {
            k: median(measured, k) for k in measured[-1] if k.startswith(("sync/", "reshard/"))
        },
        "handover": {k: median(measured, k) for k in measured[-1] if k.startswith("handover/")},
        "mismatch": median(measured, "rollout/logprob_abs_diff_mean"),
        "save_s": float(saved[-1][0]) if saved else None,
        "checkpoint_bytes": int(saved[-1][1]) if saved else None,
        "restore_s": float(restored[-1]) if restored else None,
        "wall_s": wall,
        "cpu": cpu_vector_isa().strip(" ()") or None,
    }
    result["floor_s"] = measure_floor(args, data)
    result["floor_ratio"] = step / result["floor_s"]
    return result


def parameter_count(model: Path) -> int:
    from hf_core.planner.models import load_model

    return load_model(model).num_params


def table(results: dict[tuple[str, ...], dict[str, Any]]) -> str:
    head = (
        "| model | params | pair | dtype | CPU | step s | floor x | tokens/s | generate s "
        "| update s | sync s | peak RSS GiB | resumed peak | save s | restore s | ckpt GiB "
        "| |logp diff| |\n"
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )

    def cell(value: float | None, fmt: str = ".2f") -> str:
        return "-" if value is None else format(value, fmt)

    lines = []
    for (size, pair, dtype), r in results.items():
        stages = r["stages"]
        ckpt = None if r["checkpoint_bytes"] is None else r["checkpoint_bytes"] / 2**30
        lines.append(
            f"| {size} | {r['params'] / 1e6:.1f}M | {pair} | {dtype} | {r.get('cpu') or '-'} "
            f"| {cell(r['step_s'])} "
            f"| {cell(r['floor_ratio'])} | {cell(r['tokens_per_s'], '.0f')} "
            f"| {cell(stages['generate'])} | {cell(stages['update_actor'])} "
            f"| {cell(stages['weight_sync'], '.3f')} | {cell(r['peak_rss_gib'])} "
            f"| {cell(r.get('resumed_peak_rss_gib'))} "
            f"| {cell(r['save_s'])} | {cell(r['restore_s'])} | {cell(ckpt)} "
            f"| {cell(r['mismatch'], '.1e')} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(results: dict[tuple[str, ...], dict[str, Any]], path: Path) -> bool:
    """Each cost against parameter count, log-log; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    costs = {
        "step s": lambda r: r["step_s"],
        "generate s": lambda r: r["stages"]["generate"],
        "update s": lambda r: r["stages"]["update_actor"],
        "sync s": lambda r: r["stages"]["weight_sync"],
        "peak RSS GiB": lambda r: r["peak_rss_gib"],
        "save s": lambda r: r["save_s"],
    }
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (name, get) in zip(axes.flat, costs.items(), strict=True):
        series: dict[str, list[tuple[float, float]]] = {}
        for (_size, pair, dtype), r in results.items():
            value = get(r)
            if value:
                series.setdefault(f"{pair} {dtype}", []).append((r["params"], value))
        for label, points in series.items():
            points.sort()
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set(xscale="log", yscale="log", title=name, xlabel="parameters")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join([*TINY_SHAPES, *REAL_SHAPES]))
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-lora", action="store_true", help="skip the 1.5B LoRA row")
    parser.add_argument("--lora-only", action="store_true", help="only the 1.5B LoRA row")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    add_keep_args(parser)
    parser.add_argument("--child-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_floor:
        print_result(run_ranks(floor_rank, 2, args))
        return
    unknown = sorted(set(args.pairs.split(",")) - set(PAIRS))
    if unknown:  # e.g. fsdp-hf, the transformers pair's name before the backend was renamed
        parser.error(f"--pairs: unknown {unknown}; known: {sorted(PAIRS)}")
    runs = list(
        itertools.product(args.sizes.split(","), args.pairs.split(","), args.dtypes.split(","))
    )
    if args.lora_only:
        runs = []
    if not args.no_lora:
        runs.append((LORA_SHAPE[0], "fsdp-transformers", LORA_DTYPE))
    if args.table_only:
        runs = []
    results = kept_rows(args.keep)
    with tempfile.TemporaryDirectory(prefix="hf-scale-") as tmp:
        work = Path(tmp)
        data = write_task(work / "task.jsonl", rows=256)
        for size, pair, dtype in runs:
            print(f"{size} {pair} {dtype} ...", flush=True)
            try:
                results[(size, pair, dtype)] = row = measure_row(size, pair, dtype, work, data)
            except RuntimeError as exc:
                print(f"  failed: {exc}", flush=True)
                continue
            print(f"  {json.dumps(row)}", flush=True)
            keep_row(args.keep, (size, pair, dtype), row)
    body = table(results)
    picture = ROOT / "bench" / "scale.png"
    if args.write and plot(results, picture):
        body += f"\n![costs against parameter count]({picture.name})\n"
    description = (
        f"GRPO, {PROMPTS} prompts x {SAMPLES} samples, "
        f"{NEW_TOKENS} new tokens, 2 processes x 1 thread, median of {STEPS - WARMUP} steps "
        "after a warm-up; default engine settings. 'floor x' is the step over the bare "
        "engines' generate + train_step of the same batch.  CPU: the vector ISA of the VM a "
        "row was measured on ('-': an earlier VM, not recorded); rows measured on different "
        "VMs do not compare (AVX-512 about doubles the float32 GEMM rate of AVX2)."
    )
    print(body)
    publish(TITLE, section(TITLE, description, body), args.write)


if __name__ == "__main__":
    main()
