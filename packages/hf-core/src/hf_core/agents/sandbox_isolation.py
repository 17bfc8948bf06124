"""The kernel's isolation layers around a sandboxed snippet (Linux): namespaces, an
unprivileged user and a cgroup.

Why each layer (an attacker's snippet, run with the sandbox's own API, showed each gap):

* **PID namespace** (``unshare --pid --fork --kill-child``): the snippet is PID 1 of a
  namespace of its own, so it cannot name -- let alone signal -- any process outside it (the
  rollout worker, the trainer, the host's PID 1), and when it exits the kernel kills every
  process left in the namespace: a ``setsid()`` + double-fork grandchild does not survive.
* **Network namespace** (``--net``): only a loopback device that is down, so no connection
  reaches Ray's GCS, the weight channel's TCP stores or anything else (``network: allow``
  skips it).
* **An unprivileged user** (``--setuid/--setgid`` to ``nobody``, no supplementary groups),
  when the parent is root and an interpreter that user can read exists: the snippet has no
  capabilities and no root-owned file it may write.
* **A cgroup per call** (v1 ``pids`` + ``memory`` controllers, or v2 where it is delegated):
  a cap on processes (a fork storm stops) and on the memory of all of them together (a memory
  storm across processes stops, which ``RLIMIT_AS`` per process cannot do), and a sweep that
  kills every member at the end.

* **A disk quota per call** (:class:`DiskQuota`): the call's working directory is a tmpfs of
  its own, capped in bytes and in inodes, mounted in a mount namespace of the call's own.
  Small files are cheap to write and can be slow to delete: without it a snippet wrote
  hundreds of MB of them within its output and memory caps, and deleting them afterwards could
  hold the caller for many seconds past the wall limit.  The tmpfs vanishes with the call's
  last process (nothing to delete, no mount left on the host even if the caller dies), and its
  pages count in the call's cgroup memory.

Each layer is used where the machine offers it (namespaces, cgroups and mounts need root here)
and :attr:`~hf_core.agents.sandbox.SandboxResult.isolation` says which were in force; Landlock
(file system, TCP and signal scoping), the syscall filter (seccomp) and the rlimits are applied
inside the child by :mod:`hf_core.agents.sandbox` whatever else is available.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import stat
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hf_core.renamed import PLAN_MEANS_PLACEMENT, renamed_attributes

SANDBOX_UID = SANDBOX_GID = 65534
"""``nobody``: owns no file, has no home and no capabilities."""

SYSTEM_PYTHON = "/usr/bin/python3"
"""Used when the run's own interpreter sits where ``nobody`` cannot read it (under /root)."""

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PREFIX = "hybridflow-sandbox-"

_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_SLAVE = 0x2, 0x4, 0x4000, 0x80000
_MNT_DETACH = 0x2


def _world_usable(path: Path, *, directory: bool = False) -> bool:
    """Whether a user with no relation to the owner can reach ``path`` (every parent
    searchable) and read it (and run it, for a file)."""
    try:
        path = path.resolve(strict=True)
        for parent in path.parents:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if stat.S_ISDIR(mode) != directory:
        return False
    need = stat.S_IROTH | stat.S_IXOTH
    return mode & need == need


def _interpreter_for(uid: int | None) -> tuple[str, int | None]:
    """The Python the snippet runs on and the uid it runs as: the run's own interpreter when
    ``nobody`` can use it, else the system's, else the run's own as the current user."""
    own = sys.executable
    if uid is None:
        return own, None
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if _world_usable(Path(own)) and _world_usable(stdlib, directory=True):
        return own, uid
    if _world_usable(Path(SYSTEM_PYTHON)):
        return SYSTEM_PYTHON, uid
    return own, None


@dataclass(frozen=True)
class IsolationSupport:
    """What this machine lets the sandbox use (worked out once per process)."""

    unshare: str | None
    """util-linux ``unshare``, when this process may create namespaces (root)."""
    interpreter: str
    uid: int | None
    cgroup_version: int | None
    """1 (``pids`` and ``memory`` hierarchies writable), 2 (a delegated unified tree), None."""
    disk_quota: bool = False
    """A tmpfs can be mounted over the call's directory (:class:`DiskQuota`; root)."""

    def command(self, argv: list[str], *, network: bool) -> list[str]:
        """``argv`` wrapped in the namespaces (and user) this machine supports."""
        if self.unshare is None:
            return argv
        # /proc stays the host's mount: Landlock refuses reading it
        wrap = [self.unshare, "--pid", "--fork", "--kill-child"]
        if not network:
            wrap.append("--net")
        if self.uid is not None:
            wrap += ["--setgid", str(SANDBOX_GID), "--setuid", str(self.uid)]
        return [*wrap, "--", *argv]

    def layers(self, *, network: bool) -> tuple[str, ...]:
        out = []
        if self.unshare is not None:
            out.append("pid-namespace")
            if not network:
                out.append("net-namespace")
        if self.uid is not None:
            out.append("unprivileged-user")
        return tuple(out)


def _unshare_works(binary: str) -> bool:
    """Namespaces need privileges a container or a plain user may lack: try once."""
    import subprocess

    try:
        done = subprocess.run(
            [binary, "--pid", "--fork", "--net", "--", "/bin/true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _cgroup_version() -> int | None:
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        own = _own_v2_cgroup()
        return 2 if own is not None and os.access(own, os.W_OK) else None
    if all(os.access(CGROUP_ROOT / c, os.W_OK) for c in ("pids", "memory")):
        return 1
    return None


def _own_v2_cgroup() -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return CGROUP_ROOT / line[3:].lstrip("/")
    except OSError:
        pass
    return None


@functools.cache
def isolation_support() -> IsolationSupport:
    """What the sandbox can use on this machine (checked once, on first use)."""
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    binary = shutil.which("unshare") if root and sys.platform == "linux" else None
    unshare = binary if binary and _unshare_works(binary) else None
    interpreter, uid = _interpreter_for(SANDBOX_UID if unshare is not None else None)
    cgroups = _cgroup_version() if root and sys.platform == "linux" else None
    quota = root and sys.platform == "linux" and _disk_quota_works(interpreter)
    return IsolationSupport(unshare, interpreter, uid, cgroups, quota)


def _libc() -> ctypes.CDLL | None:
    """The C library, loaded in the parent: the child between fork and exec only calls it."""
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.unshare.argtypes = [ctypes.c_int]
    return libc


_LIBC = _libc()


@dataclass(frozen=True)
class DiskQuota:
    """One call's disk quota: a tmpfs of ``size_mb`` MiB and ``files`` inodes over its working
    directory, in a mount namespace of the call's own, holding a fresh copy of ``main.py``.

    :meth:`mount` runs in the child between fork and exec (as root, before the namespaces and
    the user switch): the mount is never seen outside the call, and it vanishes with the
    call's last process, so there is nothing to unmount or delete afterwards."""

    directory: Path
    size_mb: int
    files: int
    uid: int
    gid: int
    main: bytes
    """``main.py``'s content (the copy the parent wrote is hidden under the mount)."""

    def options(self) -> bytes:
        # two inodes more than the snippet's files: the root directory and main.py
        return (
            f"size={self.size_mb}m,nr_inodes={self.files + 2},mode=0700,"
            f"uid={self.uid},gid={self.gid}"
        ).encode()

    def mount(self) -> None:
        """Enter a mount namespace of the call's own and mount the tmpfs over the directory
        (then the working directory).  Any step that fails leaves the call without the quota
        -- it runs in the plain directory, and the bootstrap reports no ``disk-quota`` -- never
        with a mount that could propagate to the host."""
        libc, target = _LIBC, bytes(self.directory)
        if libc is None or libc.unshare(_CLONE_NEWNS) != 0:
            return
        # slave: the host's mounts and unmounts still reach the namespace, none goes back
        if libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None) != 0:
            return
        if libc.mount(b"tmpfs", target, b"tmpfs", _MS_NOSUID | _MS_NODEV, self.options()) != 0:
            return
        try:
            os.chdir(target)  # into the mount: the working directory was the folder below it
            fd = os.open("main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, self.main)
            finally:
                os.close(fd)
        except OSError:  # main.py larger than the quota, say: run without it
            libc.umount2(target, _MNT_DETACH)
            os.chdir(target)


def _disk_quota_works(interpreter: str) -> bool:
    """Whether :class:`DiskQuota` mounts here (root, mount namespaces, tmpfs): try once."""
    import subprocess
    import tempfile

    probe = "import os, sys; sys.exit(os.stat('.').st_dev == os.stat('..').st_dev)"
    with tempfile.TemporaryDirectory(prefix="hf-sandbox-probe-") as folder:
        quota = DiskQuota(Path(folder), 1, 16, os.getuid(), os.getgid(), b"")
        try:
            done = subprocess.run(
                [interpreter, "-I", "-S", "-c", probe],
                cwd=folder,
                preexec_fn=quota.mount,
                capture_output=True,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            return False
    return done.returncode == 0


class CallCgroup:
    """One sandbox call's cgroup: its process and memory caps, what hit them, and the sweep.

    v1 keeps one directory per controller (``pids``, ``memory``); v2 one directory under this
    process's own (delegated) cgroup."""

    def __init__(self, version: int, processes: int, memory_bytes: int) -> None:
        name = f"{CGROUP_PREFIX}{uuid.uuid4().hex[:12]}"
        if version == 1:
            self.dirs = {c: CGROUP_ROOT / c / name for c in ("pids", "memory")}
        else:
            own = _own_v2_cgroup()
            assert own is not None
            self.dirs = {"unified": own / name}
        self.version = version
        for folder in self.dirs.values():
            folder.mkdir()
        if version == 1:
            self._write("pids", "pids.max", processes)
            self._write("memory", "memory.limit_in_bytes", memory_bytes)
        else:
            self._write("unified", "pids.max", processes)
            self._write("unified", "memory.max", memory_bytes)
            self._write("unified", "memory.swap.max", 0, required=False)

    def _write(self, key: str, name: str, value: int | str, *, required: bool = True) -> None:
        try:
            (self.dirs[key] / name).write_text(str(value))
        except OSError:
            if required:
                raise

    def join(self) -> None:
        """Move the calling process in (between fork and exec: its children follow)."""
        for folder in self.dirs.values():
            (folder / "cgroup.procs").write_text("0")

    def limit_hit(self) -> str | None:
        """``"memory"`` if the kernel's OOM killer acted in the cgroup, ``"processes"`` if a
        fork was refused at the process cap, else None."""
        if self.version == 1:
            oom = _field(self.dirs["memory"] / "memory.oom_control", "oom_kill")
            refused = _field(self.dirs["pids"] / "pids.events", "max")
        else:
            oom = _field(self.dirs["unified"] / "memory.events", "oom_kill")
            refused = _field(self.dirs["unified"] / "pids.events", "max")
        if oom:
            return "memory"
        return "processes" if refused else None

    def members(self) -> list[int]:
        pids: set[int] = set()
        for folder in self.dirs.values():
            try:
                text = (folder / "cgroup.procs").read_text()
            except OSError:
                continue
            pids.update(int(p) for p in text.split())
        return sorted(pids)

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every member until none is left (v2: ``cgroup.kill``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            members = self.members()
            if not members or time.monotonic() > deadline:
                return
            if self.version == 2:
                self._write("unified", "cgroup.kill", 1, required=False)
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        """Sweep and delete the cgroup (retried briefly while the last members exit)."""
        self.kill_all()
        for folder in self.dirs.values():
            for _ in range(100):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _field(path: Path, key: str) -> int:
    """``key value`` lines (``memory.oom_control``, ``*.events``): the value, 0 if absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def open_cgroup(support: IsolationSupport, processes: int, memory_bytes: int) -> CallCgroup | None:
    """This call's cgroup, or None where cgroups are not writable (or creating one failed)."""
    if support.cgroup_version is None:
        return None
    try:
        return CallCgroup(support.cgroup_version, processes, memory_bytes)
    except OSError:
        return None


if not TYPE_CHECKING:  # type checkers keep flagging unknown names
    __getattr__ = renamed_attributes(
        __name__,
        {"IsolationPlan": "IsolationSupport", "isolation_plan": "isolation_support"},
        PLAN_MEANS_PLACEMENT,
    )
