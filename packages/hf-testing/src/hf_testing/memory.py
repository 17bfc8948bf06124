"""Peak resident memory of a block of code, for memory tests and benches on CPU.

CPU tensors have no allocator statistics, so the process's high-water mark is the measure:
``VmHWM`` is reset to the current RSS (``/proc/self/clear_refs``) before the block and read
after it.  Large tensors are ``mmap``-ed by glibc and leave RSS when freed, so a block's peak
is its own; run ``gc.collect()`` first so earlier garbage does not count.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    text = Path("/proc/self/status").read_text()
    found = re.search(rf"{key}:\s+(\d+)", text)
    if found is None:
        raise KeyError(f"/proc/self/status has no {key} field")
    return int(found.group(1))


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


@contextmanager
def peak_rss_extra() -> Iterator[dict[str, int]]:
    """Peak RSS during the block minus RSS before it, in bytes (``["bytes"]`` after it)."""
    before = status_kib("VmRSS")
    reset_peak()
    out = {"bytes": 0}
    yield out
    out["bytes"] = (status_kib("VmHWM") - before) * 1024
