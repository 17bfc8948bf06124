"""On CPU only: hand the KV cache's pages back to the kernel while the actor trains.

On a GPU, vLLM's sleep mode frees the KV cache between generations; that needs CUDA.  On the
CPU the cache is one zero-filled buffer (``VLLM_CPU_KVCACHE_SPACE`` / ``kv_cache_bytes``,
1 GiB by default) that stays resident through every update, although nothing in it is needed
once the step's sequences are done: the prefix cache is dropped at every weight sync, and vLLM
zeroes a block before it reuses it.  :func:`drop_kv_cache_pages` returns the buffer's pages
to the kernel (``madvise(MADV_DONTNEED)``: the mapping stays, and a page reads as zeros when
next touched), so the update gets that memory and the next generation faults back in only
the blocks it uses.  At the Qwen2.5-0.5B shape in float32, with two processes, that is the
1 GiB a process that decided whether FSDP -> vLLM fits 24 GiB (docs/real_sizes.md).

The caller resets vLLM's prefix cache first, so no cached block points at dropped pages.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any

import torch

MADV_DONTNEED = 4
"""Linux: drop the pages of a private mapping; the next access reads zeros"""


def _madvise_dontneed(address: int, length: int) -> int:
    """Drop the whole pages inside ``[address, address + length)``; the bytes dropped."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + length) // page * page
    if end <= start:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(start, end - start, MADV_DONTNEED) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise(MADV_DONTNEED) of the KV cache failed: {os.strerror(errno)}")
    return end - start


def kv_cache_storages(worker: Any) -> list[torch.UntypedStorage]:
    """The distinct CPU storages behind the worker's KV cache tensors."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in getattr(worker.model_runner, "kv_caches", []):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            found.setdefault(storage.data_ptr(), storage)
    return list(found.values())


def drop_kv_cache_pages(worker: Any) -> int:
    """Run on the vLLM worker (``collective_rpc``): drop the KV cache's resident pages;
    the bytes dropped (0 where the platform is not Linux)."""
    if not sys.platform.startswith("linux"):  # MADV_DONTNEED's zero-fill is Linux's
        return 0
    return sum(
        _madvise_dontneed(storage.data_ptr(), storage.nbytes())
        for storage in kv_cache_storages(worker)
    )
