"""Environment variables every worker process starts with.

They go into each host actor's Ray ``runtime_env``, so they are set before the interpreter
starts: torch reads them once, at its first allocation, too early for a worker to set them.

``THP_MEM_ALLOC_ENABLE=1`` (a torch switch): CPU tensors of 2 MiB and more are 2 MiB-aligned
and advised onto transparent huge pages.  Why: glibc gives every large block fresh pages, so
each large temporary of a CPU step (logits, activations, their gradients) pays a page fault
per 4 KiB before its first write, most of the time of an elementwise op over it (a
``log_softmax`` over 128 x 64 x 1024 float32 logits: ~19 ms on 4 KiB pages, ~6 ms on huge
pages, on the development VM; docs/performance.md).  A GPU run never sees this (its caching
allocator keeps device memory); on the host it changes nothing but page size.  It needs the
kernel's THP mode ``madvise`` or ``always``.

CPU pools' workers also keep the memory they free (glibc's ``MALLOC_MMAP_MAX_=0``: large
blocks come from the heap rather than their own mappings; ``MALLOC_TRIM_THRESHOLD_``: the
heap is not handed back; ``MALLOC_ARENA_MAX=1``: the threads Ray runs methods on share the
main heap, as a thread's own heap maps any block over 64 MiB afresh).  Why: glibc maps each block above its mmap threshold (at most
32 MiB) afresh and returns freed heap tops to the kernel, so each update's gradients and
activations -- the same sizes every step -- paid a page fault per page again: the
Qwen2.5-0.5B-shape update took 10.4 s with the defaults and 6.6-7.5 s keeping the memory
(``bench/profile_update.py``, 2-core AMX VM; its GEMMs writing fresh gradients were most
of the difference).  The cost: a worker's resident memory does not shrink after a peak
(its later steps reuse it).  GPU workers keep glibc's defaults (their large buffers are
device memory).  A variable already set in the driver's environment (e.g.
``THP_MEM_ALLOC_ENABLE=0``) wins.
"""

from __future__ import annotations

import os

WORKER_DEFAULTS: dict[str, str] = {"THP_MEM_ALLOC_ENABLE": "1"}
CPU_WORKER_DEFAULTS: dict[str, str] = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_ARENA_MAX": "1",
}
"""For workers of pools without GPUs only (see the module docstring)."""


def worker_process_env(use_gpu: bool = False) -> dict[str, str]:
    """The defaults above for a pool with or without GPUs, less any the driver's
    environment sets itself (Ray passes the driver's own environment on to local workers)."""
    defaults = WORKER_DEFAULTS if use_gpu else {**WORKER_DEFAULTS, **CPU_WORKER_DEFAULTS}
    return {k: v for k, v in defaults.items() if k not in os.environ}
