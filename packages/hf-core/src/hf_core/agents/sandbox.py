"""A sandbox for model-written Python: a separate process with hard limits.

Each call runs the code in a fresh ``python -I -S`` process (isolated mode, standard library
only, a clean environment) whose working directory is a new empty temporary directory,
removed afterwards.  Limits, all enforced by the kernel rather than by the code itself:

* CPU time (``RLIMIT_CPU``: the process gets SIGXCPU, then SIGKILL),
* memory (``RLIMIT_AS``: allocations past it fail, so the snippet dies with MemoryError),
* disk (a tmpfs of ``disk_mb`` MiB and ``disk_files`` inodes as its working directory, where
  the machine allows; ``RLIMIT_FSIZE`` caps any one file everywhere),
* output and wall-clock time, enforced by the caller: it reads stdout and stderr from pipes it
  created itself, and kills the whole call when either passes the output cap or the call runs
  past the wall limit (a snippet that sleeps or blocks uses no CPU but is still stopped).

Around the process, where the machine allows (:mod:`hf_core.agents.sandbox_isolation`): its
own PID, network and mount namespaces (nothing outside can be signalled or connected to, and
nothing it started survives it), the unprivileged user ``nobody``, a cgroup capping the
processes and the memory of the whole call, and the disk quota.  :attr:`SandboxResult.isolation`
names what was in force.

Files: where the kernel offers Landlock (Linux 5.13+, unprivileged), the child restricts
itself before the snippet runs (and, with newer Landlock, refuses TCP and signals leaving the
sandbox): it may read only the Python standard library and the system
libraries, and read and write only its temporary directory -- the run's checkpoints, data and
code are out of reach.  Where Landlock is missing the snippet still starts in an empty
directory with no ``PYTHONPATH``, and :attr:`SandboxResult.fs_isolated` says the file system
was not locked.

Syscalls: a seccomp filter (x86_64, aarch64) refuses every socket but IPv4 and IPv6 ones --
a host's pathname unix socket (Ray's) is reached through the file system, which neither the
network namespace nor Landlock's TCP rules cover -- and socket pairs but connected unix
stream ones (``multiprocessing.Pipe``); ``ptrace``, ``process_vm_readv``/``writev`` and
``pidfd_getfd`` (nothing may take over the waiter that reports the snippet's end); io_uring
(which would run socket operations where no filter sees them); and every syscall of another
ABI (i386's ``int 0x80``, x32).

What the caller trusts: nothing it opens by a path the snippet can reach.  Output and the
snippet's end come back through pipes opened before the child started, read up to their cap
and never waited for past the wall limit (plus a second once the call is killed), whatever
the snippet holds open; the clean-up after a call is bounded too.

Plain subprocesses, no Ray: a tool call is short and local to the rollout worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hf_core.agents.sandbox_isolation import (
    SANDBOX_GID,
    CallCgroup,
    DiskQuota,
    IsolationSupport,
    isolation_support,
    open_cgroup,
)

# The child's bootstrap: lock the file system (Landlock), filter syscalls (seccomp), then run
# main.py as __main__.  It reports the layers that took and, from the waiter, the snippet's end
# on the status pipe, which only the parent reads.  Its first line marks every sandbox process.
_BOOTSTRAP_MARK = "__hf_sandbox_bootstrap__"
_BOOTSTRAP = r"""# __hf_sandbox_bootstrap__
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
MACHINE = os.uname().machine
def _landlock(read_dirs, write_dirs, deny_network):
    nr_create, nr_add, nr_restrict = 444, 445, 446
    if MACHINE not in ("x86_64", "aarch64"):
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
            allowed = rights
            if not os.path.isdir(d):  # a file takes file rights only (else EINVAL: no rule)
                allowed &= (1 << 0) | (1 << 1) | (1 << 2)  # execute, write, read file
            rule = Beneath(allowed, fd)
            libc.syscall(nr_add, ruleset, 1, ctypes.byref(rule), 0)
            os.close(fd)
    ok = libc.syscall(nr_restrict, ruleset, 0) == 0
    os.close(ruleset)
    return layers if ok else []
# audit arch, socket, socketpair, and the refused: ptrace, process_vm_readv, process_vm_writev,
# pidfd_getfd, io_uring_setup, io_uring_enter, io_uring_register
SYSCALLS = {
    "x86_64": (0xC000003E, 41, 53, (101, 310, 311, 438, 425, 426, 427)),
    "aarch64": (0xC00000B7, 198, 199, (117, 270, 271, 438, 425, 426, 427)),
}
def _seccomp():
    if MACHINE not in SYSCALLS:
        return []
    arch, sock, pair, refused = SYSCALLS[MACHINE]
    allow, deny = 0x7FFF0000, 0x00050001  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    ld, jeq, jset, ret, band = 0x20, 0x15, 0x45, 0x06, 0x54  # classic BPF opcodes
    prog = [
        (ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny),  # another ABI (int 0x80): refused
        (ld, 0, 0, 0), (jset, 0, 1, 0x40000000), (ret, 0, 0, deny),  # x32 numbers: refused
    ]
    for nr in refused:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, deny)]
    prog += [  # socket: IPv4 and IPv6 only (no unix, netlink, vsock... socket)
        (jeq, 0, 5, sock), (ld, 0, 0, 16), (jeq, 2, 0, 2), (jeq, 1, 0, 10),
        (ret, 0, 0, deny), (ret, 0, 0, allow),
    ]
    prog += [  # socketpair: unix stream only (connected already: no address can be given)
        (jeq, 0, 7, pair), (ld, 0, 0, 16), (jeq, 0, 3, 1), (ld, 0, 0, 24), (band, 0, 0, 0xF),
        (jeq, 1, 0, 1), (ret, 0, 0, deny), (ret, 0, 0, allow),
    ]
    prog.append((ret, 0, 0, allow))
    code = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *i) for i in prog))
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    program = Program(len(prog), ctypes.addressof(code))
    return ["seccomp"] if libc.prctl(22, 2, ctypes.byref(program), 0, 0) == 0 else []
status_fd = int(sys.argv[3])
layers = []
if os.stat(".").st_dev != os.stat("..").st_dev:  # a file system of its own: the quota's tmpfs
    layers.append("disk-quota")
if libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS, which both locks need
    read_dirs = sys.argv[1].split(os.pathsep) if sys.argv[1] else []
    layers += _landlock(read_dirs, [os.getcwd(), "/dev/null"], sys.argv[2] == "deny")
    layers += _seccomp()
os.write(status_fd, ("layers " + ",".join(layers) + "\n").encode())
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no one traces the waiter or reads its memory
snippet = os.fork()  # this process waits (PID 1 of the sandbox's namespace, if it has one)
if snippet:
    status = os.waitpid(snippet, 0)[1]
    os.write(status_fd, ("exit %d\n" % status).encode())  # the raw wait status, signals included
    os._exit(0)
libc.prctl(4, 1, 0, 0, 0)  # the snippet itself is as dumpable as any process
os.close(status_fd)  # the snippet cannot forge its status
source = open("main.py", encoding="utf-8").read()
sys.argv = ["main.py"]
del ctypes, struct, libc, _landlock, _seccomp, SYSCALLS, MACHINE, layers, status_fd, snippet
exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
_OUTPUT_GRACE_S = 1.0
"""After the call ended and was killed: how long output still buffered may take to arrive (the
pipes close at once when every process holding them is dead)."""
_CLEANUP_S = 1.0
"""How long the caller spends deleting the call's directory; the rest goes on in the background."""


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
    output_kb: int = Field(
        64, ge=1, description="cap on stdout and on stderr (KiB each); past it the call is killed"
    )
    processes: int = Field(
        32, ge=1, description="processes the snippet may have at once (its cgroup's pids cap)"
    )
    network: Literal["deny", "allow"] = Field(
        "deny", description="deny: no network at all (its own network namespace, Landlock TCP)"
    )
    disk_mb: int = Field(
        64,
        ge=1,
        description="size of the call's directory (MiB; its own tmpfs where the machine allows) "
        "and the largest file the snippet may write",
    )
    disk_files: int = Field(
        4096, ge=1, description="files and directories the snippet may create in its directory"
    )


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did.  ``killed`` names the limit that stopped it, if any:
    ``"wall"``, ``"cpu"``, ``"memory"``, ``"processes"``, ``"output"`` or ``"disk"``.
    ``isolation`` names the layers that were in force (``landlock-fs``, ``landlock-net``,
    ``landlock-signal``, ``seccomp``, ``disk-quota``, ``pid-namespace``, ``net-namespace``,
    ``unprivileged-user``, ``cgroup``)."""

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


def _limit(
    limits: SandboxLimits,
    cgroup: CallCgroup | None,
    cap_processes: bool,
    quota: DiskQuota | None,
) -> None:
    """Runs in the child between fork and exec: the call's cgroup joined (every process the
    snippet starts is born in it), its disk quota mounted, and the kernel-enforced limits."""
    if cgroup is not None:
        cgroup.join()
    if quota is not None:
        quota.mount()
    if cap_processes:  # no cgroup, but an unprivileged uid the per-user cap binds
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    cpu = limits.cpu_seconds
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    disk = limits.disk_mb * 2**20  # any one file, wherever it is written
    resource.setrlimit(resource.RLIMIT_FSIZE, (disk, disk))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@dataclass
class _Ending:
    """How the child's run ended, as the parent saw it."""

    exit_code: int
    wall_killed: bool
    output_killed: bool
    stdout: str
    stderr: str
    layers: tuple[str, ...]
    """What the bootstrap reported in force (Landlock, seccomp, the disk quota)."""


def _classify(end: _Ending, cgroup: CallCgroup | None) -> str | None:
    code, stderr = end.exit_code, end.stderr
    if end.output_killed:
        return "output"  # the parent killed the call at the output cap
    hit = cgroup.limit_hit() if cgroup is not None else None
    if hit is not None and (code != 0 or end.wall_killed or hit == "memory"):
        return hit  # the OOM killer's SIGKILL, or a fork refused at the process cap
    if end.wall_killed:
        return "wall"
    if code != 0 and "BlockingIOError" in stderr and "Resource temporarily" in stderr:
        return "processes"  # RLIMIT_NPROC refused a fork
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"  # SIGKILL here comes from the hard RLIMIT_CPU (the wall kill is known)
    full = ("[Errno 27] File too large", "[Errno 28] No space left on device")
    if code == -signal.SIGXFSZ or (code != 0 and any(error in stderr for error in full)):
        return "disk"  # Python ignores SIGXFSZ: the write past the cap fails instead
    if code != 0 and "MemoryError" in stderr:
        return "memory"
    return None


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a script in the sandbox and wait for it (never longer than the wall
    limit plus the time to kill it).  Never raises for anything the code does; nothing the
    code started is left running afterwards."""
    limits = limits or SandboxLimits()
    support = isolation_support()
    network = limits.network == "allow"
    start = time.monotonic()
    cgroup = open_cgroup(support, limits.processes, limits.memory_mb * 2**20)
    work = Path(tempfile.mkdtemp(prefix="hf-sandbox-"))
    try:
        main = code.encode("utf-8")
        (work / "main.py").write_bytes(main)
        if support.uid is not None:  # the unprivileged user works in it
            os.chown(work, support.uid, SANDBOX_GID)
        quota = None
        if support.disk_quota:
            uid = support.uid if support.uid is not None else os.getuid()
            gid = SANDBOX_GID if support.uid is not None else os.getgid()
            quota = DiskQuota(work, limits.disk_mb, limits.disk_files, uid, gid, main)
        end = _run(work, limits, support, cgroup, quota)
        killed = _classify(end, cgroup)
    finally:
        if cgroup is not None:
            cgroup.remove()  # sweeps any member left (a namespace-less run's survivors)
        _remove_directory(work)
    isolation = (*end.layers, *support.layers(network=network), *(("cgroup",) if cgroup else ()))
    seconds = time.monotonic() - start
    return SandboxResult(end.stdout, end.stderr, end.exit_code, killed, seconds, isolation)


def _run(
    work: Path,
    limits: SandboxLimits,
    support: IsolationSupport,
    cgroup: CallCgroup | None,
    quota: DiskQuota | None,
) -> _Ending:
    """Start the child in ``work`` and read its output until it ends, passes the output cap or
    the wall limit; kill what is left; how it ended.

    Output and status come back through pipes this process created before the child started:
    nothing is opened by a path the snippet could replace, and nothing is read past its cap
    or waited for past the wall limit (plus :data:`_OUTPUT_GRACE_S` once the call is killed),
    whatever the snippet or a process it hijacked holds open."""
    readable = os.pathsep.join(_read_dirs(support.interpreter))
    cap = limits.output_kb * 1024
    pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, status (all close-on-exec)
    (out_read, out_write), (err_read, err_write), (status_read, status_write) = pipes
    argv = [support.interpreter, "-I", "-S", "-c", _BOOTSTRAP, readable, limits.network]
    argv.append(str(status_write))
    cap_processes = cgroup is None and support.uid is not None
    streams = [_Stream(out_read, cap), _Stream(err_read, cap), _Stream(status_read, 4096)]
    try:
        proc = subprocess.Popen(
            support.command(argv, network=limits.network == "allow"),
            cwd=work,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"},
            stdin=subprocess.DEVNULL,
            stdout=out_write,
            stderr=err_write,
            start_new_session=True,  # its own process group: the wall kill takes children
            preexec_fn=lambda: _limit(limits, cgroup, cap_processes, quota),
            close_fds=True,
            pass_fds=(status_write,),
        )
        deadline = time.monotonic() + limits.wall_seconds
        for _, write_end in pipes:
            os.close(write_end)
        pipes = []
        ended = _pump(streams, deadline, proc)
        _kill_group(proc)  # no-op after a clean exit inside a PID namespace
        if cgroup is not None:
            cgroup.kill_all(timeout_s=_OUTPUT_GRACE_S)  # a session-leaving survivor too
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_OUTPUT_GRACE_S)
        _pump(streams, time.monotonic() + _OUTPUT_GRACE_S, None)  # what is still buffered
    finally:
        for stream in streams:
            os.close(stream.fd)
        for _, write_end in pipes:  # Popen failed
            os.close(write_end)
    wall_killed = ended == "deadline"
    output_killed = any(stream.over for stream in streams[:2])
    exit_code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    layers: tuple[str, ...] = ()
    for line in streams[2].data.decode("ascii", "replace").splitlines():
        key, _, value = line.partition(" ")
        if key == "layers":
            layers = tuple(x for x in value.split(",") if x)
        elif key == "exit" and value.isdigit() and not wall_killed:
            with contextlib.suppress(ValueError, OverflowError):  # not a wait status: ignored
                exit_code = os.waitstatus_to_exitcode(int(value))  # the snippet's own end
    if wall_killed:
        exit_code = -signal.SIGKILL
    stdout = bytes(streams[0].data[:cap]).decode("utf-8", "replace")
    stderr = bytes(streams[1].data[:cap]).decode("utf-8", "replace")
    return _Ending(exit_code, wall_killed, output_killed, stdout, stderr, layers)


@dataclass
class _Stream:
    """One pipe the parent reads: what came, up to ``cap`` bytes and one more to tell that the
    cap was passed (the rest is never read)."""

    fd: int
    cap: int
    data: bytearray = field(default_factory=bytearray)
    open: bool = True
    over: bool = False


def _pump(streams: list[_Stream], deadline: float, proc: subprocess.Popen[bytes] | None) -> str:
    """Read ``streams`` until ``proc`` ends (``"exited"``), an output passes its cap
    (``"cap"``), every stream is closed (``"closed"``) or ``deadline`` (``"deadline"``).  With
    ``proc`` None: until closed, a cap or the deadline.  Never blocks past the deadline."""
    poller = select.poll()
    by_fd = {}
    for stream in streams:
        if stream.open and not stream.over:
            os.set_blocking(stream.fd, False)
            poller.register(stream.fd, select.POLLIN)
            by_fd[stream.fd] = stream
    watch = _pidfd(proc) if proc is not None else None
    if watch is not None:
        poller.register(watch, select.POLLIN)
    try:
        while by_fd:
            left = deadline - time.monotonic()
            if left <= 0:
                return "deadline"
            if proc is not None and watch is None:  # no pidfd: look at the child now and then
                if proc.poll() is not None:
                    return "exited"
                left = min(left, 0.05)
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                if fd == watch:
                    return "exited"
                stream = by_fd[fd]
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:  # every writer closed it
                    stream.open = False
                    poller.unregister(fd)
                    del by_fd[fd]
                    continue
                stream.data += chunk[: stream.cap + 1 - len(stream.data)]
                if len(stream.data) > stream.cap:
                    stream.over = True
                    return "cap"
        if proc is not None:  # every pipe closed before the child's end
            left = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(left, 0))
            except subprocess.TimeoutExpired:
                return "deadline"
            return "exited"
        return "closed"
    finally:
        if watch is not None:
            os.close(watch)


def _pidfd(proc: subprocess.Popen[bytes]) -> int | None:
    """A descriptor that becomes readable when ``proc`` ends (Linux 5.3+), else None."""
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_directory(work: Path) -> None:
    """Delete the call's directory, spending at most :data:`_CLEANUP_S` of the caller's time:
    where no disk quota bounded it, it may hold very many files, and the rest is deleted in
    the background.  (With the quota it holds only ``main.py``: the tmpfs went with the call.)"""
    remover = threading.Thread(
        target=shutil.rmtree, args=(work,), kwargs={"ignore_errors": True}, daemon=True
    )
    remover.start()
    remover.join(_CLEANUP_S)


async def run_python_async(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """:func:`run_python` in a worker thread, so many tool calls run at once."""
    return await asyncio.to_thread(run_python, code, limits)
