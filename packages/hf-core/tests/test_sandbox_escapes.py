"""The escape battery: what a policy could learn to emit, run through the sandbox's own API
with its default isolation.  Each case must be stopped and reported, and after each call no
process of the snippet may remain.

The layers these cases need (namespaces, an unprivileged user, a cgroup) need root on these
machines; CI runs as root, so the battery runs there for real.  Where a layer is missing the
case that needs it is skipped with the reason, never counted as passing.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hf_core.agents.sandbox import SandboxLimits, SandboxResult, run_python
from hf_core.agents.sandbox_isolation import CGROUP_PREFIX, CGROUP_ROOT, isolation_plan

LIMITS = SandboxLimits(cpu_seconds=2, memory_mb=256, wall_seconds=5.0, output_kb=8, processes=16)
BOOTSTRAP_MARK = "__hf_sandbox_fs__"  # in every sandbox process's command line


def _needs(*layers: str) -> None:
    plan = isolation_plan()
    have = {*plan.layers(network=False), *(("cgroup",) if plan.cgroup_version else ())}
    missing = sorted(set(layers) - have)
    if missing:
        pytest.skip(f"this machine does not offer {missing} (needs root); see isolation_plan()")


def _processes_with(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if mark.encode() in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def _sandbox_cgroups() -> list[Path]:
    return [p for p in CGROUP_ROOT.glob(f"*/{CGROUP_PREFIX}*") if p.is_dir()]


@pytest.fixture
def marker() -> Iterator[str]:
    """A string the snippet's processes carry in their command line; after the call none may
    be alive, nor any sandbox process or cgroup."""
    mark = f"hf-escape-{uuid.uuid4().hex}"
    yield mark
    assert _processes_with(mark) == [], "a process of the snippet outlived the call"
    assert _processes_with(BOOTSTRAP_MARK) == [], "a sandbox process outlived the call"
    assert _sandbox_cgroups() == [], "the call's cgroup was left behind"


def _run(code: str, **limits: object) -> SandboxResult:
    return run_python(code, LIMITS.model_copy(update=limits))


def test_a_setsid_double_fork_grandchild_does_not_survive(marker: str) -> None:
    _needs("pid-namespace")
    code = f"""
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
    os._exit(0)
print("parent done")
"""
    began = time.monotonic()
    result = _run(code)
    assert result.stdout.strip() == "parent done" and result.exit_code == 0
    assert time.monotonic() - began < LIMITS.wall_seconds  # it did not wait for the sleeper
    assert "pid-namespace" in result.isolation


def test_a_fork_storm_stops_at_the_process_cap(marker: str) -> None:
    _needs("cgroup")
    code = f"""
import os, sys
SLEEP = "import time; time.sleep(30)"
started = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", SLEEP, "{marker}"])
        started += 1
finally:
    print(started, flush=True)
"""
    result = _run(code)
    assert result.killed == "processes", result
    assert int(result.stdout.split()[0]) < LIMITS.processes


def test_a_memory_storm_across_processes_stops_at_the_memory_cap(marker: str) -> None:
    """Each child stays under the per-process address-space limit; together they do not."""
    _needs("cgroup")
    code = f"""
import os, time
children = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = bytearray(120 * 2**20)  # zero-filled: resident, not just reserved
        time.sleep(2)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
print("{marker}")
"""
    result = _run(code, memory_mb=256, processes=16)
    assert result.killed == "memory", result


def test_no_connection_leaves_the_sandbox(marker: str) -> None:
    _needs("net-namespace")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = f"""
import socket
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("127.0.0.1", {port}))
    print("connected")
except OSError as exc:
    print("refused", type(exc).__name__)
"""
        result = _run(code)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert result.stdout.startswith("refused"), result
    assert {"net-namespace", "landlock-net"} & set(result.isolation)


def test_network_allow_opts_in(marker: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(5)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\nprint('ok')"
        result = _run(code, network="allow")
        conn, _ = listener.accept()
        conn.close()
    assert result.stdout.strip() == "ok", result
    assert "net-namespace" not in result.isolation


def test_no_signal_reaches_the_parent_or_the_hosts_pid_1(marker: str) -> None:
    """Signal 0 only: it checks reachability without delivering anything."""
    _needs("pid-namespace")
    code = f"""
import os
for target in ({os.getpid()}, 1):
    try:
        os.kill(target, 0)
        print(target, "reachable")
    except OSError as exc:
        print(target, type(exc).__name__)
print("ppid", os.getppid())
"""
    result = _run(code)
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert lines[str(os.getpid())] != "reachable", result
    # PID 1 inside is the sandbox's own waiter (the snippet's parent), not the host's init
    assert lines["ppid"] == "1" and "pid-namespace" in result.isolation


def test_the_run_folder_and_the_parents_environment_are_out_of_reach(
    marker: str, tmp_path: Path
) -> None:
    _needs("unprivileged-user")
    secret = tmp_path / "run" / "checkpoint.txt"
    secret.parent.mkdir()
    secret.write_text("weights")
    code = f"""
for path in ({str(secret)!r}, "/proc/{os.getpid()}/environ"):
    try:
        open(path, "rb").read()
        print("read", path)
    except OSError as exc:
        print("refused", type(exc).__name__)
"""
    result = _run(code)
    assert result.stdout.count("refused") == 2, result
    assert result.fs_isolated


def test_nothing_is_written_outside_the_temporary_directory(marker: str) -> None:
    target = Path("/tmp") / f"{marker}.txt"
    code = f"""
try:
    open({str(target)!r}, "w").write("x")
    print("wrote")
except OSError as exc:
    print("refused", type(exc).__name__)
"""
    result = _run(code)
    assert not target.exists()
    assert result.stdout.startswith("refused"), result


def test_an_output_flood_is_capped(marker: str) -> None:
    result = _run("while True:\n    print('x' * 1000)")
    assert result.killed == "output"
    assert len(result.stdout) <= LIMITS.output_kb * 1024


def test_sleeping_past_the_wall_limit_is_stopped_with_its_children(marker: str) -> None:
    code = f"""
import os, sys, time
if os.fork() == 0:
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
time.sleep(60)
"""
    result = _run(code, wall_seconds=1.0)
    assert result.killed == "wall" and result.seconds < 4
