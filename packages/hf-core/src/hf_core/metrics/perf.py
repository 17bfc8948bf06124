"""Stage timers, throughput and peak memory for the per-step metrics.

Peak memory is read by :mod:`hf_core.device` (the one place that asks the accelerator).
"""

from __future__ import annotations

import time

import torch

from hf_core.device import peak_memory, peak_rss_gib

__all__ = ["Timer", "peak_memory", "peak_rss_gib", "throughput"]


class Timer:
    """Seconds spent in a stage, added to ``into["timing/<stage>"]`` on exit.

        timings = {}
        with Timer("generate", timings):
            ...
        with Timer("update_actor", timings) as t:
            ...
        metrics.update(timings)          # {"timing/generate": 1.92, "timing/update_actor": ...}

    Re-entering a stage adds to its total.  ``cuda_sync=True`` synchronises CUDA (when it is
    initialised) on entry and exit so asynchronous kernels are charged to the right stage.
    ``t.seconds`` holds this block's own duration.
    """

    def __init__(
        self, stage: str, into: dict[str, float] | None = None, *, cuda_sync: bool = False
    ) -> None:
        self.stage = stage
        self.key = f"timing/{stage}"
        self.into = into
        self.cuda_sync = cuda_sync
        self.seconds = 0.0
        self._start: float | None = None

    def _sync(self) -> None:
        if self.cuda_sync and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def __enter__(self) -> Timer:
        self._sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._sync()
        assert self._start is not None
        self.seconds = time.perf_counter() - self._start
        if self.into is not None:
            self.into[self.key] = self.into.get(self.key, 0.0) + self.seconds


def throughput(tokens: float, seconds: float, num_devices: int = 1) -> float:
    """Tokens per second per device: ``tokens / seconds / num_devices``.

    As the paper counts it, ``tokens`` is every prompt and response token of the step's global
    batch and ``seconds`` the whole iteration's time; pass the number of devices for the
    per-device figure.
    """
    if seconds <= 0:
        raise ValueError(f"throughput needs a positive duration, got {seconds} s")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    return float(tokens) / float(seconds) / num_devices
