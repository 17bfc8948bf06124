"""The accelerator this process drives, the distributed backend that goes with it, and memory.

Defaults serve a GPU cluster: ``auto`` is this rank's CUDA device when torch sees one (Ray and
torchrun expose each rank's GPU as its current device), else the CPU; collectives use nccl on
CUDA and gloo on the CPU.  The same calls work unchanged on a CPU-only machine, so engines,
workers and metrics ask here instead of probing ``torch.cuda`` each in its own way.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DeviceChoice = Literal["auto", "cpu", "cuda"]
"""What an engine config's ``device`` key accepts."""

_GIB = float(1 << 30)


def default_device() -> torch.device:
    """This rank's current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(choice: str = "auto") -> torch.device:
    """The device an engine config asks for: ``auto`` (see :func:`default_device`), ``cuda``
    (this rank's GPU; an error without one) or ``cpu``."""
    if choice == "auto":
        return default_device()
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was asked for but torch sees no CUDA device")
        return default_device()
    if choice == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {choice!r}")


def distributed_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for collectives on ``device``: nccl on CUDA, else gloo."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def ensure_process_group(device: torch.device) -> None:
    """A one-rank group when nobody initialised torch.distributed (scripts, unit tests), so an
    engine runs the same collective code path alone as inside a worker group."""
    if dist.is_initialized():
        return
    backend = distributed_backend(device)
    log.info("torch.distributed not initialised: starting a one-rank %s group", backend)
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def collective_device() -> torch.device:
    """Where tensors for the default group's collectives must live (its backend decides)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def release_cached_memory(device: torch.device) -> None:
    """After moving tensors off ``device``: wait for the copies and return cached blocks to
    the driver, so the memory is free for another engine.  Nothing to do on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def peak_rss_gib() -> float | None:
    """This process's peak resident memory (GiB) from ``resource``; ``None`` where unavailable."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / _GIB if sys.platform == "darwin" else peak * 1024 / _GIB


def peak_memory(reset: bool = False) -> dict[str, float]:
    """Peak memory metrics of this process, in GiB.

    ``memory/peak_cuda_allocated_gib`` (``torch.cuda.max_memory_allocated``) when CUDA is
    initialised in this process, and ``memory/peak_rss_gib`` (the process's peak resident set,
    never reset by the OS) wherever ``resource`` exists.  ``reset=True`` resets the CUDA peak
    after reading it, so the next call reports the next interval's peak.
    """
    out: dict[str, float] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["memory/peak_cuda_allocated_gib"] = torch.cuda.max_memory_allocated() / _GIB
        if reset:
            torch.cuda.reset_peak_memory_stats()
    rss = peak_rss_gib()
    if rss is not None:
        out["memory/peak_rss_gib"] = rss
    return out


def reset_stage_peak() -> None:
    """Start a new peak-memory interval: the CUDA allocator's peak, and on Linux the process's
    peak resident set (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass  # not Linux, or not permitted: the interval peak becomes the process peak


def stage_peak_gib() -> float:
    """Peak memory since :func:`reset_stage_peak`: device memory when CUDA is in use (what the
    hand-over frees), else the resident set (``VmHWM``; the process peak where unreadable)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / _GIB
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / _GIB
    except OSError:
        pass
    return peak_rss_gib() or 0.0


@functools.cache
def _cpuinfo_field(name: str) -> str:
    """The first ``name`` line's value in ``/proc/cpuinfo`` ("" where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.split(":", 1)[0].strip() == name:
            return line.split(":", 1)[1].strip()
    return ""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """This CPU's vendor as ``/proc/cpuinfo`` names it (``GenuineIntel``, ``AuthenticAMD``;
    "" where it cannot be read)."""
    return _cpuinfo_field("vendor_id")


NATIVE_HALF_FLAGS = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16"}),
}
"""The CPU flags of which any one gives native GEMMs in each 16-bit float type."""


def cpu_lacks(dtype: torch.dtype) -> bool:
    """Whether this CPU has no instructions for ``dtype`` (a 16-bit float); false for other
    dtypes and when the flags cannot be read, so an unknown CPU keeps torch's own kernels."""
    native = NATIVE_HALF_FLAGS.get(dtype)
    flags = cpu_flags()
    return native is not None and bool(flags) and not flags & native


def computes_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: a CUDA GPU that supports it, or a
    CPU with AVX512-BF16 / AMX-BF16 (false where the CPU's flags cannot be read)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool(cpu_flags() & NATIVE_HALF_FLAGS[torch.bfloat16])
    return False


CPU_BFLOAT16_MIN_PARAMS = 8_000_000
"""Smaller models keep float32 rollouts on a CPU even where bfloat16 is native: their weights
stay in the caches, so a decode step is bound by its op count, not by the bytes it reads,
and bfloat16 only adds conversions (docs/performance.md, "Measured choices")."""


def inference_dtype(device: torch.device, num_params: int | None = None) -> torch.dtype:
    """The dtype a rollout engine's ``dtype: auto`` resolves to on ``device`` for a model of
    ``num_params``: bfloat16 where the device computes it natively (half the weight bytes each
    decode step reads, the dtype rollouts run in on GPUs), except for models under
    :data:`CPU_BFLOAT16_MIN_PARAMS` on a CPU; float32 elsewhere (emulated bfloat16 is slower
    than float32)."""
    if not computes_bfloat16(device):
        return torch.float32
    small = num_params is not None and num_params < CPU_BFLOAT16_MIN_PARAMS
    return torch.float32 if device.type == "cpu" and small else torch.bfloat16


def warn_if_emulated_half(device: torch.device, dtype: torch.dtype, what: str) -> None:
    """Say so when ``what`` will compute in a 16-bit float on a CPU that has no instructions
    for it: its linear layers then multiply in float32 and round to the 16-bit type (the
    backends' own widening kernels), so it runs at float32's speed at best, and products
    outside them (attention) are emulated by torch, several times slower."""
    if device.type != "cpu" or not cpu_lacks(dtype):
        return
    log.warning(
        "%s computes in %s on a CPU without %s instructions: its linear layers multiply in "
        "float32 and round to %s, so it runs no faster than float32 here (other 16-bit "
        "products are emulated); it still halves weight memory",
        what,
        str(dtype).removeprefix("torch."),
        " / ".join(sorted(NATIVE_HALF_FLAGS[dtype])),
        str(dtype).removeprefix("torch."),
    )
