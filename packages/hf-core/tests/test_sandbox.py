"""The Python sandbox: limits are enforced by the kernel and the caller always gets a result."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from hf_core.agents import sandbox as sandbox_module
from hf_core.agents.sandbox import SandboxLimits, _pump, _Stream, run_python, run_python_async
from hf_core.agents.sandbox_isolation import IsolationSupport
from hf_testing.kernel import landlock_expected

# the sandbox tests run alone (not beside pytest-xdist workers): some check that no sandbox
# process or cgroup of the machine outlives a call, which a neighbour's sandbox would break
pytestmark = pytest.mark.serial

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


def test_the_devices_it_is_given_work_under_the_lock() -> None:
    """``/dev/null`` (writable) and ``/dev/urandom`` (readable) are files: Landlock takes only
    file rights on them, and a rule asking for directory rights was refused whole, which
    left ``subprocess.DEVNULL`` failing with EACCES inside the sandbox."""
    code = (
        "import subprocess\n"
        "open('/dev/null', 'w').write('x')\n"
        "print(len(open('/dev/urandom', 'rb').read(8)))\n"
        "print(subprocess.run([__import__('sys').executable, '-c', 'print(1)'],"
        " stdout=subprocess.DEVNULL).returncode)"
    )
    result = run_python(code, FAST)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["8", "0"]


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


def test_reading_the_output_never_waits_past_the_deadline_nor_past_the_cap() -> None:
    """The caller's reader: a writer that holds a pipe open and writes nothing (a survivor, a
    hijacked waiter) cannot hold it past the deadline, one that writes without end is kept
    only up to its cap (and one byte, to know it was passed), and a closed pipe ends it."""
    read, write = os.pipe()
    try:
        stream = _Stream(read, cap=16)
        began = time.monotonic()
        assert _pump([stream], began + 0.3, None) == "deadline"
        assert 0.25 <= time.monotonic() - began < 1.0
        os.write(write, b"x" * 10)
        assert _pump([stream], time.monotonic() + 0.1, None) == "deadline"
        assert stream.data == b"x" * 10 and not stream.over
        os.write(write, b"y" * 1000)
        assert _pump([stream], time.monotonic() + 5, None) == "cap"
        assert stream.over and stream.data == b"x" * 10 + b"y" * 7
        os.write(write, b"z" * 5)
        os.close(write)
        write = -1
        rest = _Stream(read, cap=2000)
        assert _pump([rest], time.monotonic() + 5, None) == "closed"
        assert not rest.open and set(rest.data) <= set(b"yz") and rest.data.endswith(b"zzzzz")
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


def _pids_with(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_without_namespaces_a_survivor_holding_the_output_does_not_hold_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where no PID namespace or cgroup ends everything with the call (no root), a descendant
    that left the session outlives it and keeps the output pipe open: the caller still returns
    (a short grace after the snippet's end) with what was printed."""
    if sys.platform != "linux":
        pytest.skip("the sandbox's layers are Linux's")
    bare = IsolationSupport(unshare=None, interpreter=sys.executable, uid=None, cgroup_version=None)
    monkeypatch.setattr(sandbox_module, "isolation_support", lambda: bare)
    mark = f"hf-survivor-{uuid.uuid4().hex}"
    code = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    sleeper = "import os, time; print(os.getpid(), flush=True); time.sleep(30)"
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", sleeper, {mark!r}])
time.sleep(0.5)
print("parent done", flush=True)
"""
    began = time.monotonic()
    try:
        result = run_python(code, FAST.model_copy(update={"wall_seconds": 10.0}))
        took = time.monotonic() - began
    finally:
        for pid in _pids_with(mark):
            os.kill(pid, signal.SIGKILL)
    assert "parent done" in result.stdout and result.exit_code == 0, result
    assert any(word.isdigit() for word in result.stdout.split()), "no survivor shared the pipe"
    assert took < 3.0, f"the caller waited {took:.1f} s for a survivor"
    assert not {"pid-namespace", "cgroup", "disk-quota"} & set(result.isolation)
