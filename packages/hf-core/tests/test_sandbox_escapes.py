"""The escape battery: what a policy could learn to emit, run through the sandbox's own API
with its default isolation.  Each case must be stopped and reported, and after each call no
process of the snippet may remain.  Besides escapes from the snippet's box, attacks on the
caller itself (root, outside every layer): what it reads back, how long it waits and cleans up.

The layers these cases need (namespaces, an unprivileged user, a cgroup) need root on these
machines; CI runs as root, so the battery runs there for real.  Where a layer is missing the
case that needs it is skipped with the reason, never counted as passing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hf_core.agents.sandbox import SandboxLimits, SandboxResult, run_python
from hf_core.agents.sandbox_isolation import CGROUP_PREFIX, CGROUP_ROOT, isolation_support

# the sandbox tests run alone (not beside pytest-xdist workers): some check that no sandbox
# process or cgroup of the machine outlives a call, which a neighbour's sandbox would break
pytestmark = pytest.mark.serial

LIMITS = SandboxLimits(cpu_seconds=2, memory_mb=256, wall_seconds=5.0, output_kb=8, processes=16)
BOOTSTRAP_MARK = "__hf_sandbox_bootstrap__"  # in every sandbox process's command line


def _needs(*layers: str) -> None:
    support = isolation_support()
    have = {
        *support.layers(network=False),
        *(("cgroup",) if support.cgroup_version else ()),
        *(("disk-quota",) if support.disk_quota else ()),
    }
    missing = sorted(set(layers) - have)
    if missing:
        pytest.skip(f"this machine does not offer {missing} (needs root); see isolation_support()")


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


# ------------------------------------------------------------------ the caller's side
# The cases below attack the process that called the sandbox (root, outside every layer): what
# it reads back, how long it waits, what it cleans up.  Each runs the call in a caller process
# of its own, under an address-space cap and a time limit, so a caller that hangs or exhausts
# its memory fails the test instead of taking the test run down with it.

_CALLER = """
import dataclasses, json, sys
from hf_core.agents import sandbox
from hf_core.agents.sandbox import SandboxLimits, run_python
limits = SandboxLimits.model_validate_json(sys.argv[1])
for old, new in json.loads(sys.argv[2]):  # a layer switched off, to test the next one
    assert old in sandbox._BOOTSTRAP, old
    sandbox._BOOTSTRAP = sandbox._BOOTSTRAP.replace(old, new)
try:
    result = run_python(sys.stdin.read(), limits)
    print(json.dumps({"result": dataclasses.asdict(result)}))
except BaseException as exc:
    print(json.dumps({"raised": f"{type(exc).__name__}: {exc}"[:500]}))
"""
CALLER_MEMORY_MB = 512  # the caller needs about 50 MiB; a caller reading /dev/zero needs it all


def _sweep_cgroups(before: set[Path]) -> None:
    """Kill what a caller that timed out left in the cgroups it created, then remove them, so
    a failing case does not leave processes behind for the next one."""
    for folder in set(_sandbox_cgroups()) - before:
        for _ in range(50):
            try:
                pids = [int(p) for p in (folder / "cgroup.procs").read_text().split()]
            except OSError:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                folder.rmdir()
                break
            time.sleep(0.05)


def _call_bounded(
    code: str,
    limits: SandboxLimits,
    *,
    timeout_s: float,
    bootstrap_edits: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    """``run_python(code, limits)`` in a caller process of its own: ``{"result": fields}``,
    ``{"raised": what}``, ``{"timeout": seconds}`` or ``{"crashed": stderr}``, and the
    seconds the caller took (``"seconds"``).  ``bootstrap_edits``: text replacements in the
    sandbox's bootstrap, each required to apply (a layer switched off)."""

    def cap_memory() -> None:
        size = CALLER_MEMORY_MB * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (size, size))

    before = set(_sandbox_cgroups())
    began = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CALLER, limits.model_dump_json(), json.dumps(bootstrap_edits)],
            input=code,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            preexec_fn=cap_memory,
        )
    except subprocess.TimeoutExpired:
        _sweep_cgroups(before)
        return {"timeout": timeout_s, "seconds": time.monotonic() - began}
    seconds = time.monotonic() - began
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"crashed": f"exit {done.returncode}: {done.stderr[-2000:]}", "seconds": seconds}
    return {**json.loads(lines[-1]), "seconds": seconds}


_SWAPS = {
    "a link to a root-only host file": "os.symlink(SECRET, name)",
    "a FIFO": "os.mkfifo(name)",
    "a link to /dev/zero": "os.symlink('/dev/zero', name)",
    "nothing (deleted)": "pass",
}


@pytest.mark.parametrize("swap", list(_SWAPS), ids=["secret-link", "fifo", "dev-zero", "deleted"])
def test_replacing_the_output_files_reaches_nothing_of_the_caller(
    marker: str, tmp_path: Path, swap: str
) -> None:
    """Output used to go to files of the run folder the root parent read back by name: a link
    read any host file as root, a FIFO hung the caller, /dev/zero exhausted its memory and a
    deleted file raised.  Whatever the snippet does to its folder, the caller gets the output
    it printed, within the wall limit, and never a host file."""
    secret = tmp_path / "root-only.txt"
    secret.write_text(f"root secret {marker}")
    secret.chmod(0o600)
    code = f"""
import os, sys
SECRET = {str(secret)!r}
for name in (".stdout", ".stderr", "stdout", "stderr"):
    try:
        os.remove(name)
    except OSError:
        pass
    {_SWAPS[swap]}
print("printed", flush=True)
print("warned", file=sys.stderr, flush=True)
"""
    limits = LIMITS.model_copy(update={"wall_seconds": 3.0})
    outcome = _call_bounded(code, limits, timeout_s=limits.wall_seconds + 10)
    assert "result" in outcome, outcome
    result = outcome["result"]
    assert marker not in result["stdout"] + result["stderr"], "the caller read a host file"
    assert result["stdout"] == "printed\n" and result["stderr"] == "warned\n", result
    assert result["exit_code"] == 0 and result["killed"] is None, result
    assert outcome["seconds"] < limits.wall_seconds + 3, outcome


def _world_reachable_dir() -> Path:
    """A folder under /tmp the sandbox's user can reach (pytest's tmp_path is root-only)."""
    folder = Path(tempfile.mkdtemp(prefix="hf-escape-sockets-", dir="/tmp"))
    folder.chmod(0o755)
    return folder


def _seccomp_expected() -> bool:
    """The sandbox's syscall filter must be in force here: Linux with seccomp filters, on an
    architecture whose syscall numbers it knows."""
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "aarch64"):
        return False
    try:
        return "Seccomp:" in Path("/proc/self/status").read_text()
    except OSError:
        return False


def _needs_seccomp(result: SandboxResult) -> None:
    if _seccomp_expected():
        assert "seccomp" in result.isolation, f"the kernel has seccomp but: {result}"
    elif "seccomp" not in result.isolation:
        pytest.skip("no seccomp filter on this machine (kernel or architecture)")


def test_no_unix_socket_of_the_host_is_reachable(marker: str) -> None:
    """A pathname unix socket (Ray's, any mode-0777 one) is reached through the file system:
    neither the network namespace nor Landlock's TCP rules cover it.  Stream connect, datagram
    send, and a datagram socket pair's send are all refused; a stream socket pair (what
    ``multiprocessing.Pipe`` uses) still works."""
    folder = _world_reachable_dir()
    stream_path, dgram_path = folder / "stream.sock", folder / "dgram.sock"
    try:
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener,
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as inbox,
        ):
            listener.bind(str(stream_path))
            inbox.bind(str(dgram_path))
            for path in (stream_path, dgram_path):
                path.chmod(0o777)
            listener.listen(1)
            listener.settimeout(0.5)
            inbox.settimeout(0.5)
            code = f"""
import socket
def attempt(name, action):
    try:
        action()
        print(name, "reached")
    except OSError as exc:
        print(name, "refused", type(exc).__name__)
def stream():
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect({str(stream_path)!r})
def dgram():
    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"x", {str(dgram_path)!r})
def pair_dgram():
    socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0].sendto(b"x", {str(dgram_path)!r})
attempt("stream", stream)
attempt("dgram", dgram)
attempt("pair-dgram", pair_dgram)
a, b = socket.socketpair()
a.sendall(b"ok")
print("pair-stream", b.recv(2).decode())
"""
            result = _run(code)
            with pytest.raises(TimeoutError):
                listener.accept()
            with pytest.raises(TimeoutError):
                inbox.recv(16)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    for name in ("stream", "dgram", "pair-dgram"):
        assert lines.get(name, "").startswith("refused"), result
    assert lines.get("pair-stream") == "ok", result
    _needs_seccomp(result)


def test_32_bit_syscalls_do_not_bypass_the_syscall_filter(marker: str) -> None:
    """On x86_64 a process can enter the kernel through ``int 0x80`` with the i386 syscall
    numbers (``socket`` is 359 there, not 41): the filter must refuse a foreign architecture
    outright rather than match its numbers as x86_64's."""
    if os.uname().machine != "x86_64":
        pytest.skip("int 0x80 (the i386 syscall entry) exists on x86_64 only")
    code = """
import ctypes, mmap
# push rbx; mov eax, 359 (i386 socket); mov ebx, 1 (AF_UNIX); mov ecx, 1 (SOCK_STREAM);
# xor edx, edx; int 0x80; pop rbx; ret
machine = bytes.fromhex("53b867010000bb01000000b90100000031d2cd805bc3")
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(machine)
address = ctypes.addressof(ctypes.c_char.from_buffer(page))
print("i386 socket", ctypes.CFUNCTYPE(ctypes.c_int)(address)())
"""
    result = _run(code)
    if result.exit_code == -signal.SIGSEGV:
        pytest.skip("this kernel has no i386 syscall entry (IA32 emulation off)")
    assert result.stdout.startswith("i386 socket "), result
    assert int(result.stdout.split()[-1]) < 0, f"a unix socket was created: {result}"
    _needs_seccomp(result)


def test_io_uring_is_refused(marker: str) -> None:
    """io_uring runs socket and connect operations inside the kernel, where no syscall filter
    sees them: setting one up must be refused."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("the syscall number below is x86_64's and aarch64's")
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
fd = libc.syscall(425, 8, params)  # io_uring_setup(8 entries)
print("io_uring", fd, ctypes.get_errno())
"""
    result = _run(code)
    _, fd, error = result.stdout.split()
    assert int(fd) < 0, f"io_uring was set up: {result}"
    _needs_seccomp(result)
    assert int(error) == errno.EPERM, result  # the filter's answer, not a missing io_uring


def test_no_process_outside_the_snippet_can_be_traced_or_read(marker: str) -> None:
    """The namespace's first process (the waiter that reports the snippet's end) is the
    snippet's parent, same user, same Landlock domain: neither ``ptrace`` nor
    ``process_vm_readv`` may reach it."""
    _needs("pid-namespace")
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("the syscall numbers below are x86_64's and aarch64's")
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
waiter = os.getppid()
attached = libc.ptrace(16, waiter, None, None)  # PTRACE_ATTACH
print("attach", attached, ctypes.get_errno())
if attached == 0:
    os.waitpid(waiter, 0)
    libc.ptrace(17, waiter, None, None)  # PTRACE_DETACH
class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buffer = ctypes.create_string_buffer(8)
mine, theirs = IoVec(ctypes.addressof(buffer), 8), IoVec(0x400000, 8)
nr = {"x86_64": 310, "aarch64": 270}[os.uname().machine]  # process_vm_readv
libc.syscall.restype = ctypes.c_long
read = libc.syscall(nr, waiter, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
print("vm_read", read, ctypes.get_errno())
"""
    result = _run(code)
    lines = {line.split()[0]: line.split()[1:] for line in result.stdout.strip().splitlines()}
    assert lines["attach"] == ["-1", str(errno.EPERM)], result
    # refused for the right reason: not a bad address in the waiter, but no access at all
    assert lines["vm_read"] == ["-1", str(errno.EPERM)], result


_HIJACK = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
NAMES = ("r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp "
         "ss fs_base gs_base ds es fs gs").split()
class Regs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_ulonglong) for name in NAMES]
waiter = os.getppid()
os.setsid()  # out of the caller's process group: its kill at the wall limit misses us
if libc.ptrace(16, waiter, None, None) != 0:  # PTRACE_ATTACH
    print("ptrace refused", ctypes.get_errno(), flush=True)
    sys.exit(0)
os.waitpid(waiter, 0)
saved = Regs()
libc.ptrace(12, waiter, None, ctypes.byref(saved))  # PTRACE_GETREGS
word = libc.ptrace(1, waiter, ctypes.c_void_p(saved.rip - 2), None)  # PTRACE_PEEKTEXT
if word & 0xFFFF != 0x050F:  # not stopped right after a syscall instruction
    print("no syscall to reuse", flush=True)
    sys.exit(0)
def inject(number, *args):
    regs = Regs.from_buffer_copy(saved)
    regs.rip, regs.rax, regs.orig_rax = saved.rip - 2, number, 2**64 - 1
    regs.rdi, regs.rsi = (list(args) + [0, 0])[:2]
    libc.ptrace(13, waiter, None, ctypes.byref(regs))  # PTRACE_SETREGS
    libc.ptrace(9, waiter, None, None)  # PTRACE_SINGLESTEP over the syscall
    os.waitpid(waiter, 0)
    libc.ptrace(12, waiter, None, ctypes.byref(regs))
    return ctypes.c_longlong(regs.rax).value
# the waiter leaves the caller's process group and forgets its parent-death signal
print("setsid", inject(112), "pdeathsig", inject(157, 1, 0), flush=True)
back = Regs.from_buffer_copy(saved)
back.rip, back.rax, back.orig_rax = saved.rip - 2, saved.orig_rax, 2**64 - 1  # wait4 again
libc.ptrace(13, waiter, None, ctypes.byref(back))
libc.ptrace(17, waiter, None, None)  # PTRACE_DETACH: it waits for us, and we sleep
time.sleep(3600)
"""


def test_a_hijacked_waiter_neither_outlives_the_call_nor_blocks_the_caller(marker: str) -> None:
    """With ``ptrace`` the snippet could make its waiter (which holds the end of the status
    pipe) leave the caller's process group and drop its parent-death signal, then keep it
    waiting: the waiter outlived the wall kill and the caller blocked on the pipe for ever."""
    _needs("pid-namespace")
    if os.uname().machine != "x86_64":
        pytest.skip("the register layout of the injection below is x86_64's")
    limits = LIMITS.model_copy(update={"wall_seconds": 3.0})
    outcome = _call_bounded(_HIJACK, limits, timeout_s=limits.wall_seconds + 15)
    assert "result" in outcome, outcome
    assert outcome["seconds"] < limits.wall_seconds + 3, outcome
    assert outcome["result"]["stdout"].startswith("ptrace refused"), outcome


def test_the_caller_returns_in_time_even_from_a_hijacked_waiter(marker: str) -> None:
    """Defence in depth: with the syscall filter and the waiter's non-dumpable flag switched
    off, the hijack succeeds -- and still the caller reads no pipe past the wall limit, and the
    call's cgroup kills the waiter that left the process group (the fixture checks that no
    sandbox process survives)."""
    _needs("pid-namespace", "cgroup")
    if os.uname().machine != "x86_64":
        pytest.skip("the register layout of the injection below is x86_64's")
    limits = LIMITS.model_copy(update={"wall_seconds": 3.0})
    edits = (
        ("layers += _seccomp()", "pass"),
        ("libc.prctl(4, 0, 0, 0, 0)", "pass"),
    )
    outcome = _call_bounded(
        _HIJACK, limits, timeout_s=limits.wall_seconds + 15, bootstrap_edits=edits
    )
    assert "result" in outcome, outcome
    result = outcome["result"]
    if result["stdout"].startswith("no syscall to reuse"):
        pytest.skip("the waiter was not stopped right after a syscall instruction here")
    assert result["stdout"].startswith("setsid "), f"the hijack did not take: {outcome}"
    assert "seccomp" not in result["isolation"]
    assert result["killed"] == "wall", outcome
    assert outcome["seconds"] < limits.wall_seconds + 3, outcome


# ------------------------------------------------------------------------ the disk quota


def test_many_small_files_stop_at_the_disk_quota_and_the_call_returns_in_time(
    marker: str,
) -> None:
    """Small files are cheap to write (hundreds of MB a second) and slow to delete: without a
    quota the snippet filled the disk past every other cap and the clean-up after the call ran
    for many seconds outside the wall limit."""
    _needs("disk-quota")
    limits = LIMITS.model_copy(update={"disk_mb": 64, "disk_files": 500})
    code = """
n = 0
try:
    while True:
        with open(f"f{n}", "wb") as f:
            f.write(b"x" * 512)
        n += 1
except OSError as exc:
    print(n, exc.errno, flush=True)
    raise
"""
    began = time.monotonic()
    result = run_python(code, limits)
    took = time.monotonic() - began
    assert result.killed == "disk", result
    written, error = (int(x) for x in result.stdout.split())
    assert error == errno.ENOSPC and written == limits.disk_files, result
    assert took < 2.0, f"the call took {took:.1f} s"
    assert "disk-quota" in result.isolation


def test_a_large_file_stops_at_the_disk_quota(marker: str) -> None:
    _needs("disk-quota")
    limits = LIMITS.model_copy(update={"disk_mb": 16, "memory_mb": 256})
    code = """
written = 0
try:
    with open("big", "wb") as f:
        while True:
            f.write(b"x" * 2**20)
            f.flush()
            written += 1
except OSError as exc:
    print(written, exc.errno, flush=True)
    raise
"""
    began = time.monotonic()
    result = run_python(code, limits)
    assert result.killed == "disk", result
    written, error = (int(x) for x in result.stdout.split())
    assert error in (errno.ENOSPC, errno.EFBIG) and written <= 16, result
    assert time.monotonic() - began < 2.0
