"""Keep freed host memory for reuse in CPU worker processes (glibc's ``mallopt``).

Why: glibc serves every block above its mmap threshold (128 KiB, growing up to 32 MiB) with a
fresh ``mmap`` and unmaps it on free, so each large temporary tensor (logits, activations,
their gradients) lands on new pages and pays a page fault per 4 KiB before its first write.
On a CPU training step that is most of the time of every elementwise op over such a tensor:
a ``log_softmax`` over 128 x 64 x 1024 float32 logits takes ~20 ms on fresh pages against
~4 ms on reused ones (measured on the 2-core development VM; ``docs/performance.md``).  A GPU
framework never sees this, because its caching allocator keeps device memory; this is the
host-side equivalent: large blocks come from the heap, and up to ``retain_bytes`` of freed
memory stays mapped instead of going back to the OS.

The cost is resident memory: a process keeps (up to the limit) what it freed at its peak, the
same trade a caching allocator makes.  Other C libraries (musl) or platforms leave the
policy unchanged and say so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
"""glibc ``mallopt`` parameters (``malloc.h``)."""

_applied: int | None = None


def retain_freed_memory(retain_bytes: int) -> bool:
    """Serve large blocks from the heap and keep up to ``retain_bytes`` of freed memory.

    Returns whether the policy is in force (glibc on Linux).  ``retain_bytes <= 0`` leaves
    the C library's defaults.  Idempotent: every role of a process may call it.
    """
    global _applied
    if retain_bytes <= 0 or not sys.platform.startswith("linux"):
        return False
    if _applied is not None:
        return True
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt in %s: host allocator left at its defaults", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    limit = min(int(retain_bytes), 2**31 - 1)
    # no mmap for large blocks (they come from the heap, so a free keeps their pages) and
    # no trimming of the heap's free top below ``limit``
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, limit)):
        log.warning("mallopt refused the retain policy: host allocator left at its defaults")
        return False
    _applied = limit
    return True
