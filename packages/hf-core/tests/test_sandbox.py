"""The Python sandbox: limits are enforced by the kernel and the caller always gets a result."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from hf_core.agents.sandbox import SandboxLimits, run_python, run_python_async
from hf_testing.kernel import landlock_expected

FAST = SandboxLimits(cpu_seconds=1, memory_mb=256, wall_seconds=2.0, output_kb=4)


def test_runs_code_and_returns_output() -> None:
    result = run_python("import math\nprint(math.factorial(10))", FAST)
    assert result.ok and result.stdout.strip() == "3628800" and result.killed is None


def test_an_exception_is_a_result_not_a_raise() -> None:
    result = run_python("raise ValueError('boom')", FAST)
    assert result.exit_code == 1 and result.killed is None and "ValueError: boom" in result.stderr


def test_a_hanging_snippet_is_killed_at_the_wall_limit_and_the_caller_goes_on() -> None:
    start = time.monotonic()
    result = run_python("import time\ntime.sleep(60)", FAST)
    assert result.killed == "wall" and not result.ok
    assert time.monotonic() - start < FAST.wall_seconds + 3
    assert run_python("print('next')", FAST).stdout.strip() == "next"


def test_a_busy_loop_is_killed_at_the_cpu_limit() -> None:
    result = run_python("while True:\n    pass", FAST.model_copy(update={"wall_seconds": 10}))
    assert result.killed == "cpu" and result.seconds < 5


def test_a_memory_hungry_snippet_hits_the_memory_limit() -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))"
    result = run_python(code, FAST)
    assert result.killed == "memory" and "MemoryError" in result.stderr
    assert run_python("print(2 + 2)", FAST).stdout.strip() == "4"


def test_output_is_capped() -> None:
    result = run_python("while True:\n    print('x' * 1000)", FAST)
    assert result.killed == "output" and len(result.stdout) <= FAST.output_kb * 1024


def test_the_snippet_sees_only_its_own_directory(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("run data")
    code = (
        f"open('scratch.txt', 'w').write('mine')\nprint(open('scratch.txt').read())\n"
        f"print(open({str(secret)!r}).read())"
    )
    result = run_python(code, FAST)
    assert result.stdout.startswith("mine")  # its own temporary directory is writable
    # skip only where the kernel itself has no Landlock, never on the sandbox's own word
    if landlock_expected():
        assert result.fs_isolated, "the kernel offers Landlock but the sandbox did not lock"
    elif not result.fs_isolated:
        pytest.skip("this kernel has no Landlock: the file system lock is not available")
    assert "PermissionError" in result.stderr and "run data" not in result.stdout


def test_the_environment_is_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_SECRET_TOKEN", "s3cret")
    result = run_python("import os, sys\nprint(os.environ.get('HF_SECRET_TOKEN'), sys.path)", FAST)
    assert result.stdout.startswith("None") and "site-packages" not in result.stdout


def test_async_calls_run_concurrently() -> None:
    async def many() -> list[float]:
        code = "import time\ntime.sleep(0.5)"
        results = await asyncio.gather(*[run_python_async(code, FAST) for _ in range(4)])
        return [r.seconds for r in results]

    start = time.monotonic()
    asyncio.run(many())
    assert time.monotonic() - start < 1.8
