"""Soak: the demo workload for thousands of steps, every process's resources sampled
(``nox -s soak``; not in the default matrix).

Runs ``recipes/demo.yaml`` (the README demo's model and task) for ``--steps`` RL steps with a
checkpoint every ``--save-every`` steps, in a private Ray instance, and every ``--interval``
seconds samples each process of the run (the driver, Ray's own processes and the workers):
resident memory, open file descriptors and threads, plus the host's shared memory in use
(``/dev/shm``: Ray's object store and the ranks' exchange file live there).  After the
warm-up (the first ``--warmup`` share of the run) the mean of the last window must stay within
``--max-growth`` of the mean of the first window, for the run's total resident memory, shared
memory, and every long-lived process's memory, descriptors and threads: a leak of any of them
grows without bound over a long run.

    python faults/soak.py --steps 3000 --write     # updates faults/RESULTS.md and its plot
    python faults/soak.py --steps 60 --save-every 20 --interval 1 --max-growth 1.0   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from hf_testing.ray_nodes import marked_processes

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "demo.yaml"
MARKER = "HF_SOAK_RUN"
RESULTS = Path(__file__).with_name("RESULTS.md")
PLOT = Path(__file__).with_name("soak.png")
SECTION = "## Soak (`nox -s soak`, `faults/soak.py`)"
METRICS = ("rss_mib", "fds", "threads")


@dataclass
class Sample:
    seconds: float
    step: int
    shm_mib: float
    processes: dict[str, dict[str, float]] = field(default_factory=dict)
    """process label (``<pid> <name>``) -> metric -> value"""
    control: dict[str, dict[str, float]] = field(default_factory=dict)
    """the same for the idle Ray instance sampled alongside (:func:`idle_ray`)"""


_LABELS: dict[int, str] = {}


def _label(pid: int, cmd: str) -> str:
    """``<pid> <name>``, fixed at first sight: Ray retitles its workers as they run methods
    (``ray::IDLE``, ``ray::WorkerProcess.execute``), which must not split one process's series."""
    if pid not in _LABELS:
        words = cmd.split()
        name = next((w for w in words if w.startswith("ray::")), words[0] if words else "?")
        name = name.split(".")[0] if name.startswith("ray::") else Path(name).name
        _LABELS[pid] = f"{pid} {name}"
    return _LABELS[pid]


def _process_metrics(pid: int) -> dict[str, float] | None:
    proc = Path("/proc") / str(pid)
    try:
        status = dict(
            line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line
        )
        return {
            "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
            "threads": int(status["Threads"]),
            "fds": len(os.listdir(proc / "fd")),
        }
    except (OSError, KeyError, ValueError):
        return None  # gone meanwhile, or a kernel thread


def _latest_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        if line.strip():
            return int(json.loads(line).get("step", 0))
    return 0


def _sample_marked(token: str) -> dict[str, dict[str, float]]:
    found = {}
    for pid, cmd in marked_processes(token, MARKER).items():
        metrics = _process_metrics(pid)
        if metrics is not None:
            found[_label(pid, cmd)] = metrics
    return found


def sample(token: str, control: str, out: Path, began: float) -> Sample:
    shm = shutil.disk_usage("/dev/shm").used / 2**20 if Path("/dev/shm").is_dir() else 0.0
    now = Sample(time.monotonic() - began, _latest_step(out), shm)
    now.processes = _sample_marked(token)
    now.control = _sample_marked(control)
    return now


RAY_DAEMONS = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
"""Ray's own processes, which an idle instance runs too (drivers and workers are the run's)."""

IDLE_RAY = "import ray, time\nray.init(include_dashboard=False, num_cpus=1)\ntime.sleep(10**6)\n"


@contextmanager
def idle_ray(token: str) -> Iterator[None]:
    """An idle local Ray instance for the length of the run, its processes marked ``token``.

    Why: Ray's own daemons grow by themselves (an idle instance's ``gcs_server`` went from
    43.9 to 46.7 MiB over five minutes on the development VM), which says nothing about the
    run.  A Ray daemon of the run may grow by the bound plus what the same daemon of the idle
    instance grew over the same windows."""
    ray_tmp = tempfile.mkdtemp(prefix="hfc-", dir="/tmp")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, **{MARKER: token})
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", IDLE_RAY],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # ray.init's atexit stops its daemons
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in marked_processes(token, MARKER):  # a daemon its shutdown missed
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _window_mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def running(samples: list[Sample]) -> list[Sample]:
    """``samples`` without the trailing ones taken while the run was shutting down (fewer
    processes than it usually has): those would compare a half-stopped run with a whole one."""
    usual = statistics.mode(len(s.processes) for s in samples)
    end = max(i for i, s in enumerate(samples) if len(s.processes) >= usual)
    return samples[: end + 1]


def compared_windows(
    samples: list[Sample], warmup: float
) -> tuple[list[Sample], list[Sample]] | None:
    """The first and last tenth of the steady run after the warm-up (None: too few samples)."""
    steady = running(samples)
    kept = [s for s in steady if s.seconds >= warmup * steady[-1].seconds]
    if len(kept) < 4:
        return None
    width = max(2, len(kept) // 10)
    return kept[:width], kept[-width:]


def growth_report(samples: list[Sample], warmup: float, max_growth: float) -> list[str]:
    """Each series whose last-window mean exceeds its first-window mean (after the warm-up) by
    more than ``max_growth``: the run's total RSS, shared memory, and each process present in
    both windows.  Empty when nothing grew."""
    windows = compared_windows(samples, warmup)
    if windows is None:
        return ["too few samples after the warm-up"]
    first, last = windows
    series: dict[str, tuple[list[float], list[float]]] = {
        "total rss_mib": (
            [sum(p["rss_mib"] for p in s.processes.values()) for s in first],
            [sum(p["rss_mib"] for p in s.processes.values()) for s in last],
        ),
        "shm_mib": ([s.shm_mib for s in first], [s.shm_mib for s in last]),
    }
    in_first = {label for s in first for label in s.processes}
    for label in in_first & {label for s in last for label in s.processes}:
        for metric in METRICS:
            series[f"{label} {metric}"] = (
                [s.processes[label][metric] for s in first if label in s.processes],
                [s.processes[label][metric] for s in last if label in s.processes],
            )
    problems = []
    for name, (before, after) in sorted(series.items()):
        start, end = _window_mean(before), _window_mean(after)
        slack = 1.0 if name.endswith(("fds", "threads")) else 0.0  # one descriptor comes and goes
        idle = idle_growth(first, last, name)
        if end > start * (1 + max_growth + max(idle or 0.0, 0.0)) + slack:
            problems.append(
                f"{name}: {start:.1f} -> {end:.1f} (+{100 * (end / start - 1):.1f}%"
                + (f"; the idle Ray's +{100 * idle:.1f}%" if idle is not None else "")
                + ")"
            )
    return problems


def idle_growth(first: list[Sample], last: list[Sample], series: str) -> float | None:
    """How much the idle Ray instance's process of the same name grew over the same windows
    (a share: 0.05 is 5%), for a series ``<pid> <name> <metric>``; None when it has none."""
    parts = series.split(" ")
    if len(parts) != 3 or parts[1] not in RAY_DAEMONS:
        return None
    _, name, metric = parts

    def mean(window: list[Sample]) -> float:
        values = [
            metrics[metric]
            for s in window
            for label, metrics in s.control.items()
            if label.endswith(f" {name}")
        ]
        return _window_mean(values)

    start, end = mean(first), mean(last)
    return end / start - 1 if start > 0 and end > 0 else None


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    steps = [s.step for s in samples]
    labels = sorted({label for s in samples for label in s.processes})
    for ax, metric in zip(axes.flat, METRICS, strict=False):
        for label in labels:
            ax.plot(
                steps,
                [s.processes.get(label, {}).get(metric, float("nan")) for s in samples],
                label=label,
                linewidth=0.8,
            )
        ax.set_title(metric.replace("_", " "))
    shm_ax = axes.flat[3]
    shm_ax.plot(steps, [s.shm_mib for s in samples], color="k")
    shm_ax.set_title("/dev/shm used (MiB)")
    for ax in axes[1]:
        ax.set_xlabel("RL step")
    axes.flat[0].legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _build_assets(folder: Path) -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("demo", ROOT / "recipes" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_assets(folder)


def run(args: argparse.Namespace, workdir: Path) -> tuple[list[Sample], int, Path]:
    """Start the run, sample it until it ends; the samples, its exit code and its folder."""
    token = uuid.uuid4().hex
    out = workdir / "run"
    assets = _build_assets(workdir / "assets")
    ray_tmp = tempfile.mkdtemp(prefix="hfs-", dir="/tmp")  # short unix socket paths
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, **{MARKER: token})
    env.pop("RAY_ADDRESS", None)
    overrides = [f"{key}={value}" for key, value in assets.items()] + [
        f"run.output_dir={out}",
        f"run.total_steps={args.steps}",
        f"run.save_every={args.save_every}",
        "run.val_every=0",
        "run.progress=false",
        "sft.steps=20",
    ]
    cmd = [sys.executable, "-m", "hf_core.cli", "run", str(RECIPE), *overrides]
    log = (workdir / "run.log").open("w")
    control = uuid.uuid4().hex
    samples: list[Sample] = []
    with idle_ray(control):
        began = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        try:
            while proc.poll() is None:
                now = sample(token, control, out, began)
                if now.processes:
                    samples.append(now)
                time.sleep(args.interval)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    return samples, proc.returncode, out


def _write_results(text: str) -> None:
    old = RESULTS.read_text() if RESULTS.exists() else ""
    if SECTION in old:
        head, _, rest = old.partition(SECTION)
        tail = rest.split("\n## ", 1)
        old = head + ("## " + tail[1] if len(tail) > 1 else "")
    RESULTS.write_text(old.rstrip() + "\n\n" + text.strip() + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.1, help="share of the run left out")
    parser.add_argument("--max-growth", type=float, default=0.05)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument("--write", action="store_true", help="update faults/RESULTS.md + plot")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hf-soak-"))
    samples, code, out = run(args, workdir)
    with (workdir / "samples.jsonl").open("w") as raw:  # the series behind the plot
        for s in samples:
            raw.write(json.dumps(dataclasses.asdict(s)) + "\n")
    if code != 0 or not samples:
        print(f"the run failed (exit {code}); log: {workdir / 'run.log'}")
        return 1
    problems = growth_report(samples, args.warmup, args.max_growth)
    path = PLOT if args.write else workdir / "soak.png"
    plot(samples, path)
    last = running(samples)[-1]
    total = sum(p["rss_mib"] for p in last.processes.values())
    windows = compared_windows(samples, args.warmup)
    idle = idle_growth(*windows, "0 gcs_server rss_mib") if windows else None
    summary = (
        f"{SECTION}\n\n`python faults/soak.py --steps {args.steps} --save-every "
        f"{args.save_every}`: {_latest_step(out)} steps of `recipes/demo.yaml` in "
        f"{last.seconds / 60:.0f} min, {len(samples)} samples of {len(last.processes)} "
        f"processes every {args.interval:.0f} s; at the end {total:.0f} MiB resident in all, "
        f"{last.shm_mib:.0f} MiB of /dev/shm.  Growth after the first {100 * args.warmup:.0f}% "
        f"(last tenth against first tenth, bound {100 * args.max_growth:.0f}%; a Ray daemon's "
        "bound adds what the same daemon of an idle Ray instance grew alongside"
        + (f", the idle gcs_server's RSS: +{100 * idle:.1f}%" if idle is not None else "")
        + "): "
        + ("; ".join(problems) if problems else "none")
        + f".  Plot: `faults/{PLOT.name}`.\n"
    )
    print(summary)
    if args.write:
        _write_results(summary)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
