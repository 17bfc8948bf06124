"""A standalone rollout rank's generation thread for ``rollout.mode: streaming``.

The trainer submits prompts (:meth:`StreamingGenerator.submit`) and collects finished samples
(:meth:`StreamingGenerator.collect`) through the worker's ordinary calls; generation itself
runs on a thread of its own, so it goes on between those calls and while the actor trains.
A weight broadcast pauses the thread at a token boundary (:meth:`StreamingGenerator.paused`),
loads, and lets it go on: the responses under way continue with the new weights (partial
rollouts), each token tagged with the version that sampled it.

With ``whole_calls=True`` each submission is one ``generate`` call of the engine with the
submission's own sampling parameters, and its output rows go back as they are
(:class:`FinishedRows`).  That is ``rollout.max_staleness: 0`` (the trainer waits for every
sample before it updates, so no update can arrive mid-generation: exactly the samples the
synchronous loop draws), and the agent loop (multi-turn with tools: an update lands between
two agent calls, never inside one).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hf_core.batch import Batch
from hf_core.engines import SamplingParams, strip_left_padding
from hf_core.engines.streaming import (
    ChunkedStream,
    GeneratesBatches,
    OpensTokenStream,
    StreamRequest,
    TokenStream,
)


class StreamFailed(RuntimeError):
    """The generation thread raised; the message carries its traceback."""


def requests_for(prompts: Batch, params: SamplingParams, epoch: int) -> list[StreamRequest]:
    """``params.n`` requests per prompt row, keyed by (epoch, sample_index, sample)."""
    rows = strip_left_padding(prompts["input_ids"], prompts["attention_mask"])
    indices = [int(i) for i in prompts["sample_index"]]
    return [
        StreamRequest((epoch, index, k), row, params)
        for row, index in zip(rows, indices, strict=True)
        for k in range(params.n)
    ]


@dataclass
class FinishedRows:
    """One whole ``generate`` call's output: its rows as the engine returned them (plus
    ``token_versions``, ``interrupted`` and ``rollout_version``) and each row's key."""

    keys: list[tuple[int, int, int]]
    rows: Batch


def whole_rows(requests: list[StreamRequest], out: Batch, version: int) -> FinishedRows:
    """Tag a whole call's output with the version of the weights that generated it."""
    mask = out["response_mask"]
    real = out["attention_mask"][:, -mask.shape[1] :]  # agent turns: tool tokens included
    out["token_versions"] = torch.where(real.bool(), version, -1).long()
    out["interrupted"] = torch.zeros(len(out), dtype=torch.bool)
    return FinishedRows([r.key for r in requests], out)


class StreamingGenerator:
    """Generation that runs between the worker's calls (see the module docstring)."""

    def __init__(
        self,
        engine: GeneratesBatches,
        version: Callable[[], int],
        *,
        capacity: int,
        chunk_tokens: int,
        whole_calls: bool,
        partial: bool = True,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"stream capacity must be >= 1, got {capacity}")
        self.engine, self.version, self.capacity = engine, version, capacity
        self.whole_calls, self.partial = whole_calls, partial
        self.stream: TokenStream = (
            engine.open_stream(capacity, chunk_tokens)
            if isinstance(engine, OpensTokenStream)
            else ChunkedStream(engine, chunk_tokens)
        )
        self._waiting: deque[StreamRequest] = deque()
        self._whole: deque[tuple[Batch, SamplingParams, list[StreamRequest]]] = deque()
        self._done: list[StreamRequest | FinishedRows] = []
        self._cond = threading.Condition()
        self._pause_requested = False
        self._paused = threading.Event()
        self._stop = False
        self._error: str | None = None
        self._idle_s = 0.0
        self._busy_s = 0.0
        self._interrupted = 0
        self._thread = threading.Thread(target=self._run, name="rollout-stream", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- the trainer's side
    def submit(self, prompts: Batch, params: SamplingParams, epoch: int) -> None:
        """Queue ``params.n`` samples of every prompt row (keys: epoch, sample_index)."""
        requests = requests_for(prompts, params, epoch)
        with self._cond:
            if self.whole_calls:
                self._whole.append((prompts, params, requests))
            else:
                self._waiting.extend(requests)
            self._cond.notify_all()

    def collect(self, wait_s: float = 0.0) -> list[StreamRequest | FinishedRows]:
        """The samples finished since the last call, waiting up to ``wait_s`` for one."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not self._done and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._error is not None:
                raise StreamFailed(f"the rollout stream's generation thread failed:\n{self._error}")
            done, self._done = self._done, []
        return done

    def metrics(self) -> dict[str, float]:
        """Time the thread had nothing to decode (or was paused) and time it decoded, since
        the last call; requests a weight update reached mid-generation."""
        with self._cond:
            idle, busy, self._idle_s, self._busy_s = self._idle_s, self._busy_s, 0.0, 0.0
            interrupted, self._interrupted = self._interrupted, 0
            queued = len(self._waiting) + sum(len(r) for _, _, r in self._whole)
        take_stats = getattr(self.stream, "take_stats", None)
        stats: dict[str, float] = take_stats() if callable(take_stats) else {}
        return {
            **stats,
            "stream/pool_idle_s": idle,
            "stream/pool_busy_s": busy,
            "stream/interrupted_requests": float(interrupted),
            "stream/queued_samples": float(queued),
            "stream/decoding_samples": float(self.stream.active),
        }

    @contextmanager
    def paused(self, weights_change: bool = True) -> Iterator[None]:
        """Hold the thread at a token boundary: for a weight load (the responses under way
        continue after it with the new weights; without partial rollouts the thread first
        finishes them, starting no new ones), or for another use of the engine meanwhile
        (``weights_change=False``: validation's generate call)."""
        with self._cond:
            self._pause_requested = True
            self._paused.clear()
            self._cond.notify_all()
        while not self._paused.wait(0.05):
            if not self._thread.is_alive():
                break
        try:
            yield
        finally:
            with self._cond:
                if weights_change:
                    self._interrupted += self.stream.active
                    self.stream.weights_changed()
                self._pause_requested = False
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            while self._next():
                pass
        except BaseException:  # surfaced by the next collect, with its traceback
            with self._cond:
                self._error = traceback.format_exc()
                self._cond.notify_all()
            self._paused.set()

    def _next(self) -> bool:
        """One round: wait while paused or idle, admit what fits, decode; False to stop."""
        start = time.perf_counter()
        with self._cond:
            while not self._stop and (
                (self._pause_requested and (self.partial or not self.stream.active))
                or (not self.stream.active and not self._waiting and not self._whole)
            ):
                if self._pause_requested:
                    self._paused.set()
                self._cond.wait()
            if self._stop:
                return False
            draining = self._pause_requested  # without partial rollouts: finish, start none
            whole = None if draining or not self._whole else self._whole.popleft()
            room = 0 if draining else self.capacity - self.stream.active
            admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        waited = time.perf_counter() - start
        version = self.version()
        if whole is not None:
            prompts, params, requests = whole
            with torch.no_grad():
                out = self.engine.generate(prompts, params)
            done: list[StreamRequest | FinishedRows] = [whole_rows(requests, out, version)]
        else:
            if admitted:
                self.stream.admit(admitted)
            done = list(self.stream.advance(version))
        with self._cond:
            self._idle_s += waited
            self._busy_s += time.perf_counter() - start - waited
            if done:
                self._done += done
                self._cond.notify_all()
        return True
