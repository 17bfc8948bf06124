"""A sandbox for model-written Python: a separate process with hard limits.

Each call runs the code in a fresh ``python -I -S`` process (isolated mode, standard library
only, a clean environment) whose working directory is a new empty temporary directory,
removed afterwards.  Limits, all enforced by the kernel rather than by the code itself:

* CPU time (``RLIMIT_CPU``: the process gets SIGXCPU, then SIGKILL),
* memory (``RLIMIT_AS``: allocations past it fail, so the snippet dies with MemoryError),
* output (stdout and stderr go to files capped by ``RLIMIT_FSIZE``),
* wall-clock time (the caller kills the whole process group when it runs past it: a snippet
  that sleeps or blocks uses no CPU but is still stopped).

Files: where the kernel offers Landlock (Linux 5.13+, unprivileged), the child restricts
itself before the snippet runs: it may read only the Python standard library and the system
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

from pydantic import BaseModel, ConfigDict, Field

# The child's bootstrap: lock the file system (Landlock), then run main.py as __main__.
# It prints one marker line on stderr saying whether the lock took, which the parent strips.
_BOOTSTRAP = r"""
import ctypes, os, sys
FS_MARK = "__hf_sandbox_fs__"
def _landlock(read_dirs, write_dirs):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    nr_create, nr_add, nr_restrict = 444, 445, 446
    if os.uname().machine not in ("x86_64", "aarch64"):
        return False
    if libc.syscall(nr_create, None, 0, 1) < 1:  # ABI version; < 1: not available
        return False
    read = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
    handled = (1 << 13) - 1  # every right of Landlock ABI 1
    attr = ctypes.c_uint64(handled)
    ruleset = libc.syscall(nr_create, ctypes.byref(attr), 8, 0)
    if ruleset < 0:
        return False
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
        return False
    ok = libc.syscall(nr_restrict, ruleset, 0) == 0
    os.close(ruleset)
    return ok
read_dirs = sys.argv[1].split(os.pathsep) if sys.argv[1] else []
locked = _landlock(read_dirs, [os.getcwd(), "/dev/null"])
sys.stderr.write(FS_MARK + ("1" if locked else "0") + "\n")
sys.stderr.flush()
source = open("main.py", encoding="utf-8").read()
sys.argv = ["main.py"]
del ctypes, _landlock, read_dirs, locked
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


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did.  ``killed`` names the limit that stopped it, if any:
    ``"wall"``, ``"cpu"``, ``"memory"`` or ``"output"``."""

    stdout: str
    stderr: str
    exit_code: int
    killed: str | None
    seconds: float
    fs_isolated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None


def _read_dirs() -> list[str]:
    """What the child may read: the interpreter's standard library and system libraries (never
    a virtual environment's site-packages or the working tree)."""
    dirs = {
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
        str(Path(sys.executable).resolve().parent),
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


def _limit(limits: SandboxLimits) -> None:
    """Runs in the child between fork and exec: the kernel-enforced limits."""
    cpu = limits.cpu_seconds
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    out = limits.output_kb * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _classify(code: int, stderr: str, limits: SandboxLimits, wall_killed: bool) -> str | None:
    if wall_killed:
        return "wall"
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"  # SIGKILL here comes from the hard RLIMIT_CPU (the wall kill is known)
    if code == -signal.SIGXFSZ or (code != 0 and "[Errno 27] File too large" in stderr):
        return "output"  # Python ignores SIGXFSZ: the write past the cap fails instead
    if code != 0 and "MemoryError" in stderr:
        return "memory"
    return None


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a script in the sandbox and wait for it (never longer than the wall
    limit plus the time to kill it).  Never raises for anything the code does."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hf-sandbox-") as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(code, encoding="utf-8")
        out_path, err_path = work / ".stdout", work / ".stderr"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, os.pathsep.join(_read_dirs())],
                cwd=work,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: the wall kill takes children
                preexec_fn=lambda: _limit(limits),
                close_fds=True,
            )
            wall_killed = False
            try:
                exit_code = proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                wall_killed = True
                _kill_group(proc)
                exit_code = proc.wait()
        cap = limits.output_kb * 1024
        stdout = out_path.read_bytes()[:cap].decode("utf-8", "replace")
        stderr = err_path.read_bytes()[:cap].decode("utf-8", "replace")
    first, _, rest = stderr.partition("\n")
    fs_isolated = False
    if first.startswith(_FS_MARK):
        fs_isolated, stderr = first.endswith("1"), rest
    killed = _classify(exit_code, stderr, limits, wall_killed)
    return SandboxResult(stdout, stderr, exit_code, killed, time.monotonic() - start, fs_isolated)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def run_python_async(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """:func:`run_python` in a worker thread, so many tool calls run at once."""
    return await asyncio.to_thread(run_python, code, limits)
