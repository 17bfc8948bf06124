"""What the kernel offers, probed by the tests themselves: a test that needs a feature the
machine has must fail when the code under test reports it missing, not skip."""

from __future__ import annotations

import ctypes
import os
import platform
import re

LANDLOCK_SINCE = (5, 13)
"""The first Linux release with Landlock."""


def kernel_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the running Linux kernel; ``None`` on another system."""
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    if platform.system() != "Linux" or found is None:
        return None
    return int(found[1]), int(found[2])


def landlock_expected() -> bool:
    """Whether the sandbox must manage to lock the file system here, decided without its code:
    Linux 5.13 or later, an architecture whose syscall numbers the sandbox uses (x86_64,
    aarch64), and the kernel answering ``landlock_create_ruleset``'s ABI-version query (Landlock
    built in and not blocked, e.g. by a container's seccomp filter)."""
    version = kernel_version()
    if version is None or version < LANDLOCK_SINCE:
        return False
    if os.uname().machine not in ("x86_64", "aarch64"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return int(libc.syscall(444, None, 0, 1)) >= 1  # LANDLOCK_CREATE_RULESET_VERSION
