"""Concurrent endpoint requests become batched engine calls.

Agents send requests one at a time each, but many agents run at once.  A single thread owns
the engine: it takes every request waiting (after a short gathering window, so requests that
arrive together share a call), groups them by sampling parameters, and makes one
``generate`` call per group.  vLLM and SGLang then batch the rows continuously inside the
call; the transformers engine decodes the rows of a call together.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hf_core.engines.decoding import left_padded
from hf_core.engines.rollout import RolloutEngine, SamplingParams
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY

GATHER_WINDOW_S = 0.01
"""How long the engine thread waits after the first request for others to join its call."""


@dataclass(frozen=True)
class Completion:
    """The engine's answer to one request."""

    tokens: list[int]
    log_probs: list[float]
    version: int
    """The policy version of the weights that sampled it."""
    routed: torch.Tensor | None = None
    """Routing replay (``params.routed_experts`` on an MoE model): the experts of every
    position the call fed, ``[context + tokens, moe layers, k]`` from the context's first
    token (the last sampled token, never fed, unrecorded)."""


@dataclass
class _Request:
    context: list[int]
    params: SamplingParams
    future: concurrent.futures.Future[Completion] = field(default_factory=concurrent.futures.Future)


class EngineBatcher:
    """Owns ``engine`` in a thread of its own; :meth:`submit` from any thread."""

    def __init__(
        self, engine: RolloutEngine, pad_token_id: int, version: Callable[[], int]
    ) -> None:
        self.engine, self.pad_token_id, self.version = engine, pad_token_id, version
        self.calls = 0
        self.rows = 0
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="endpoint-engine", daemon=True)
        self._thread.start()

    def submit(
        self, context: list[int], params: SamplingParams
    ) -> concurrent.futures.Future[Completion]:
        """Queue one completion of ``context`` (``params.n`` must be 1)."""
        if params.n != 1:
            raise ValueError("the endpoint samples one completion per request (n=1)")
        request = _Request(context, params)
        self._queue.put(request)
        return request.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            waiting: list[_Request | None] = [first]
            try:
                waiting.append(self._queue.get(timeout=GATHER_WINDOW_S))
                while True:
                    waiting.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            stop = None in waiting
            self._serve([r for r in waiting if r is not None])  # then stop, if asked
            if stop:
                return

    def _serve(self, requests: list[_Request]) -> None:
        """One call per group of equal parameters.  The seed is not part of the key (each
        trajectory's requests would never share a call): a call takes the seed of its first
        request, moved on per call, so rows of one call and calls of one run all differ."""
        groups: dict[SamplingParams, list[_Request]] = {}
        for request in requests:
            key = request.params.model_copy(update={"seed": None})
            groups.setdefault(key, []).append(request)
        for key, group in groups.items():
            seed = group[0].params.seed
            params = key.model_copy(
                update={"seed": None if seed is None else seed + 7919 * self.calls}
            )
            try:
                contexts = left_padded([r.context for r in group], self.pad_token_id)
                out = self.engine.generate(contexts, params)
            except BaseException as exc:  # the requests fail, the server goes on
                for request in group:
                    request.future.set_exception(exc)
                continue
            self.calls += 1
            self.rows += len(group)
            version = self.version()
            mask = out["response_mask"].bool()
            routed = out[ROUTED_EXPERTS_KEY] if ROUTED_EXPERTS_KEY in out else None
            width = contexts["input_ids"].shape[1]
            for row, request in enumerate(group):
                tokens = out["responses"][row][mask[row]].tolist()
                log_probs = out["rollout_log_probs"][row][mask[row]].tolist()
                fed = None
                if routed is not None:  # columns as input_ids: the context left-padded
                    fed = routed[row, width - len(request.context) : width + len(tokens)]
                request.future.set_result(Completion(tokens, log_probs, version, fed))
