"""A sandbox for model-written Python: a separate process with hard limits.

Each call runs the code in a fresh ``python -I -S`` process (isolated mode, standard library
only, a clean environment) whose working directory is a new empty temporary directory,
removed afterwards.  Limits, all enforced by the kernel rather than by the code itself:

* CPU time (``RLIMIT_CPU``: the process gets SIGXCPU, then SIGKILL),
* memory (``RLIMIT_AS``: allocations past it fail, so the snippet dies with MemoryError),
* output (stdout and stderr go to files capped by ``RLIMIT_FSIZE``),
* wall-clock time (the caller kills the whole call when it runs past it: a snippet that
  sleeps or blocks uses no CPU but is still stopped).

Around the process, where the machine allows (:mod:`hf_core.agents.sandbox_isolation`): its
own PID and network namespaces (nothing outside can be signalled or connected to, and nothing
it started survives it), the unprivileged user ``nobody``, and a cgroup capping the processes
and the memory of the whole call.  :attr:`SandboxResult.isolation` names what was in force.

Files: where the kernel offers Landlock (Linux 5.13+, unprivileged), the child restricts
itself before the snippet runs (and, with newer Landlock, refuses TCP and signals leaving the
sandbox): it may read only the Python standard library and the system
libraries, and read and write only its temporary directory -- the run's checkpoints, data and
code are out of reach.  Where Landlock is missing the snippet still starts in an empty
directory with no ``PYTHONPATH``, and :attr:`SandboxResult.fs_isolated` says the file system
was not locked.

Plain subprocesses, no Ray: a tool call is short and local to the rollout worker.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hf_core.agents.sandbox_isolation import (
    SANDBOX_GID,
    CallCgroup,
    IsolationPlan,
    isolation_plan,
    open_cgroup,
)

# The child's bootstrap: lock the file system (Landlock), then run main.py as __main__.
# It prints one marker line on stderr saying whether the lock took, which the parent strips.
_BOOTSTRAP = r"""
import ctypes, os, sys
FS_MARK = "__hf_sandbox_fs__"
def _landlock(read_dirs, write_dirs, deny_network):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    nr_create, nr_add, nr_restrict = 444, 445, 446
    if os.uname().machine not in ("x86_64", "aarch64"):
        return []
    abi = libc.syscall(nr_create, None, 0, 1)  # ABI version; < 1: not available
    if abi < 1:
        return []
    read = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
    handled = (1 << 13) - 1  # every right of Landlock ABI 1
    layers = ["landlock-fs"]
    net = 0
    if deny_network and abi >= 4:  # TCP bind and connect, with no rule allowing any port
        net = (1 << 0) | (1 << 1)
        layers.append("landlock-net")
    scoped = 0
    if abi >= 6:  # no signals to, nor abstract sockets of, processes outside the sandbox
        scoped = (1 << 0) | (1 << 1)
        layers.append("landlock-signal")
    attr = (ctypes.c_uint64 * 3)(handled, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(nr_create, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return []
    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
    for dirs, rights in ((read_dirs, read), (write_dirs, handled)):
        for d in dirs:
            try:
                fd = os.open(d, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            rule = Beneath(rights, fd)
            libc.syscall(nr_add, ruleset, 1, ctypes.byref(rule), 0)
            os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return []
    ok = libc.syscall(nr_restrict, ruleset, 0) == 0
    os.close(ruleset)
    return layers if ok else []
read_dirs = sys.argv[1].split(os.pathsep) if sys.argv[1] else []
locked = _landlock(read_dirs, [os.getcwd(), "/dev/null"], sys.argv[2] == "deny")
sys.stderr.write(FS_MARK + ",".join(locked) + "\n")
sys.stderr.flush()
status_fd = int(sys.argv[3])
snippet = os.fork()  # this process waits (PID 1 of the sandbox's namespace, if it has one)
if snippet:
    status = os.waitpid(snippet, 0)[1]
    os.write(status_fd, str(status).encode())  # the raw wait status, signals included
    os._exit(0)
os.close(status_fd)  # the snippet cannot forge its status
source = open("main.py", encoding="utf-8").read()
sys.argv = ["main.py"]
del ctypes, _landlock, read_dirs, locked, status_fd, snippet
exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
_FS_MARK = "__hf_sandbox_fs__"


class SandboxLimits(BaseModel):
    """The limits of one sandboxed run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_seconds: int = Field(5, ge=1, description="CPU time before the kernel kills the process")
    memory_mb: int = Field(
        512, ge=32, description="address-space limit (MiB); allocations past it fail"
    )
    wall_seconds: float = Field(
        10.0, gt=0, description="wall-clock time before the process group is killed"
    )
    output_kb: int = Field(64, ge=1, description="cap on stdout and on stderr (KiB each)")
    processes: int = Field(
        32, ge=1, description="processes the snippet may have at once (its cgroup's pids cap)"
    )
    network: Literal["deny", "allow"] = Field(
        "deny", description="deny: no network at all (its own network namespace, Landlock TCP)"
    )


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did.  ``killed`` names the limit that stopped it, if any:
    ``"wall"``, ``"cpu"``, ``"memory"``, ``"processes"`` or ``"output"``.  ``isolation`` names
    the layers that were in force (``landlock-fs``, ``landlock-net``, ``landlock-signal``,
    ``pid-namespace``, ``net-namespace``, ``unprivileged-user``, ``cgroup``)."""

    stdout: str
    stderr: str
    exit_code: int
    killed: str | None
    seconds: float
    isolation: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None

    @property
    def fs_isolated(self) -> bool:
        """The file system was locked (Landlock): only the standard library readable and
        only the call's temporary directory writable."""
        return "landlock-fs" in self.isolation


def _read_dirs(interpreter: str) -> list[str]:
    """What the child may read: the interpreter's standard library and system libraries (never
    a virtual environment's site-packages or the working tree)."""
    dirs = {
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
        str(Path(sys.executable).resolve().parent),
        str(Path(interpreter).resolve().parent),
        "/usr/lib",
        "/usr/lib64",
        "/lib",
        "/lib64",
        "/usr/local/lib",
        "/usr/share/zoneinfo",
        "/dev/urandom",
    }
    dynload = Path(sysconfig.get_paths()["platstdlib"]) / "lib-dynload"
    dirs.add(str(dynload))
    return sorted(d for d in dirs if os.path.exists(d))


def _limit(limits: SandboxLimits, cgroup: CallCgroup | None, cap_processes: bool) -> None:
    """Runs in the child between fork and exec: the kernel-enforced limits, and the call's
    cgroup joined (every process the snippet starts is born in it)."""
    if cgroup is not None:
        cgroup.join()
    if cap_processes:  # no cgroup, but an unprivileged uid the per-user cap binds
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    cpu = limits.cpu_seconds
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    out = limits.output_kb * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _classify(code: int, stderr: str, wall_killed: bool, cgroup: CallCgroup | None) -> str | None:
    hit = cgroup.limit_hit() if cgroup is not None else None
    if hit is not None and (code != 0 or wall_killed or hit == "memory"):
        return hit  # the OOM killer's SIGKILL, or a fork refused at the process cap
    if wall_killed:
        return "wall"
    if code != 0 and "BlockingIOError" in stderr and "Resource temporarily" in stderr:
        return "processes"  # RLIMIT_NPROC refused a fork
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"  # SIGKILL here comes from the hard RLIMIT_CPU (the wall kill is known)
    if code == -signal.SIGXFSZ or (code != 0 and "[Errno 27] File too large" in stderr):
        return "output"  # Python ignores SIGXFSZ: the write past the cap fails instead
    if code != 0 and "MemoryError" in stderr:
        return "memory"
    return None


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a script in the sandbox and wait for it (never longer than the wall
    limit plus the time to kill it).  Never raises for anything the code does; nothing the
    code started is left running afterwards."""
    limits = limits or SandboxLimits()
    plan = isolation_plan()
    network = limits.network == "allow"
    start = time.monotonic()
    cgroup = open_cgroup(plan, limits.processes, limits.memory_mb * 2**20)
    try:
        with tempfile.TemporaryDirectory(prefix="hf-sandbox-") as tmp:
            work = Path(tmp)
            (work / "main.py").write_text(code, encoding="utf-8")
            if plan.uid is not None:  # the unprivileged user works in it
                os.chown(work, plan.uid, SANDBOX_GID)
            exit_code, wall_killed, stdout, stderr = _run(work, limits, plan, cgroup)
        first, _, rest = stderr.partition("\n")
        layers: tuple[str, ...] = ()
        if first.startswith(_FS_MARK):
            layers, stderr = tuple(x for x in first[len(_FS_MARK) :].split(",") if x), rest
        killed = _classify(exit_code, stderr, wall_killed, cgroup)
    finally:
        if cgroup is not None:
            cgroup.remove()  # sweeps any member left (a namespace-less run's survivors)
    isolation = (*layers, *plan.layers(network=network), *(("cgroup",) if cgroup else ()))
    return SandboxResult(stdout, stderr, exit_code, killed, time.monotonic() - start, isolation)


def _run(
    work: Path, limits: SandboxLimits, plan: IsolationPlan, cgroup: CallCgroup | None
) -> tuple[int, bool, str, str]:
    """Start the child in ``work``, wait up to the wall limit, kill what is left; the exit
    code, whether the wall limit killed it, and its capped output."""
    readable = os.pathsep.join(_read_dirs(plan.interpreter))
    status_read, status_write = os.pipe()
    argv = [plan.interpreter, "-I", "-S", "-c", _BOOTSTRAP, readable, limits.network]
    argv.append(str(status_write))
    cap_processes = cgroup is None and plan.uid is not None
    out_path, err_path = work / ".stdout", work / ".stderr"
    with out_path.open("wb") as out, err_path.open("wb") as err, os.fdopen(status_read) as status:
        proc = subprocess.Popen(
            plan.command(argv, network=limits.network == "allow"),
            cwd=work,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own process group: the wall kill takes children
            preexec_fn=lambda: _limit(limits, cgroup, cap_processes),
            close_fds=True,
            pass_fds=(status_write,),
        )
        os.close(status_write)
        wall_killed = False
        try:
            exit_code = proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            wall_killed = True
            exit_code = -signal.SIGKILL
        _kill_group(proc)  # no-op after a clean exit inside a PID namespace
        proc.wait()
        reported = status.read().strip()
        if reported.isdigit() and not wall_killed:  # the snippet's own end, not its waiter's
            exit_code = os.waitstatus_to_exitcode(int(reported))
    cap = limits.output_kb * 1024
    stdout = out_path.read_bytes()[:cap].decode("utf-8", "replace")
    stderr = err_path.read_bytes()[:cap].decode("utf-8", "replace")
    return exit_code, wall_killed, stdout, stderr


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_python_async(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """:func:`run_python` in a worker thread, so many tool calls run at once."""
    return await asyncio.to_thread(run_python, code, limits)
