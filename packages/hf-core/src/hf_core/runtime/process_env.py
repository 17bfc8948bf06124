"""Environment variables every worker process starts with.

They go into each worker process's Ray ``runtime_env``, so they are set before the interpreter
starts: torch reads them once, at its first allocation, too early for a worker to set them.

``THP_MEM_ALLOC_ENABLE=1`` (a torch switch): CPU tensors of 2 MiB and more are 2 MiB-aligned and
advised onto transparent huge pages.  Why: glibc gives every large block fresh pages, so each
large temporary of a CPU step (logits, activations, their gradients) pays a page fault per 4 KiB
before its first write, most of the time of an elementwise op over it (a large ``log_softmax``
runs about three times faster on huge pages; docs/performance.md, "Measured choices").  A GPU
run never sees this (its caching allocator keeps device memory); on the host it changes nothing
but page size.  It needs the kernel's THP mode ``madvise`` or ``always``; a variable already set
in the driver's environment (e.g. ``THP_MEM_ALLOC_ENABLE=0``) wins.
"""

from __future__ import annotations

import os

WORKER_DEFAULTS: dict[str, str] = {"THP_MEM_ALLOC_ENABLE": "1"}


def worker_process_env() -> dict[str, str]:
    """The defaults above, less any the driver's environment sets itself (Ray passes the
    driver's own environment on to local workers)."""
    return {k: v for k, v in WORKER_DEFAULTS.items() if k not in os.environ}
