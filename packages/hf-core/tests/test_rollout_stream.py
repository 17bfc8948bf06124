"""The rollout rank's generation thread (hf_core.roles.rollout_stream) on a scripted engine.

- A weight load pauses the thread between two tokens: tokens before it carry the old
  version, tokens after it the new one, and the stream is told its cache is stale.
- Without partial rollouts the load waits until the responses under way ended.
- With ``whole_calls`` (max_staleness 0, the agent loop) each submission is one generate
  call with the submission's own parameters (seed included), its rows returned as they are.
- An exception on the thread reaches the next collect with its traceback.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from hf_core.batch import Batch
from hf_core.engines import NamedTensor, RolloutEngine, SamplingParams
from hf_core.engines.streaming import StreamRequest, responses_batch
from hf_core.roles.rollout_stream import FinishedRows, StreamFailed, StreamingGenerator

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=5)


class ScriptedStream:
    """Every advance gives each request one token (its count so far); a gate can hold it."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.requests: list[StreamRequest] = []
        self.changes = 0
        self.advances = 0
        self.gate = threading.Semaphore(10_000)
        self.fail_after = fail_after

    @property
    def active(self) -> int:
        return len(self.requests)

    def admit(self, requests: list[StreamRequest]) -> None:
        self.requests += requests

    def weights_changed(self) -> None:
        self.changes += 1

    def advance(self, version: int) -> list[StreamRequest]:
        self.gate.acquire()
        self.advances += 1
        if self.fail_after is not None and self.advances > self.fail_after:
            raise ValueError("scripted decode failure")
        for request in self.requests:
            request.extend([len(request.tokens) + 10], [-0.5], version)
        done = [r for r in self.requests if r.finished]
        self.requests = [r for r in self.requests if not r.finished]
        return done


class ScriptedEngine(RolloutEngine):
    def __init__(self, stream: ScriptedStream) -> None:
        self.stream = stream
        self.calls: list[SamplingParams] = []

    def open_stream(self, capacity: int, chunk_tokens: int) -> ScriptedStream:
        return self.stream

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.calls.append(params)
        rows = len(prompts) * params.n
        width = params.max_new_tokens
        requests = [
            StreamRequest((0, i, 0), [1, 2], params, [7] * width, [-1.0] * width, [0] * width)
            for i in range(rows)
        ]
        return responses_batch(requests, 0)

    def load_weights(self, bucket: Iterable[NamedTensor]) -> None:
        pass


def _prompts(count: int) -> Batch:
    batch = Batch(
        {
            "input_ids": torch.tensor([[0, 5, 6]] * count),
            "attention_mask": torch.tensor([[0, 1, 1]] * count),
        }
    )
    batch["sample_index"] = __import__("numpy").array(list(range(count)), dtype=object)
    return batch


def _collect_all(gen: StreamingGenerator, count: int, timeout: float = 10) -> list[Any]:
    done: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(done) < count and time.monotonic() < deadline:
        done += gen.collect(0.05)
    assert len(done) == count, f"{len(done)} of {count} samples finished"
    return done


def _generator(stream: ScriptedStream, partial: bool = True, **kw: object) -> StreamingGenerator:
    version = {"v": 0}
    gen = StreamingGenerator(
        ScriptedEngine(stream),
        lambda: version["v"],
        capacity=8,
        chunk_tokens=4,
        whole_calls=bool(kw.get("whole_calls", False)),
        partial=partial,
    )
    gen.version_box = version  # type: ignore[attr-defined]
    return gen


def test_a_weight_load_lands_between_two_tokens() -> None:
    stream = ScriptedStream()
    stream.gate = threading.Semaphore(3)  # three tokens, then the thread waits for the gate
    gen = _generator(stream)
    gen.submit(_prompts(2), PARAMS, epoch=0)
    while stream.advances < 3:
        time.sleep(0.01)
    # the pause asks while the thread waits inside its 4th advance: it must finish that
    # token and stop before the 5th
    threading.Timer(0.2, stream.gate.release).start()
    with gen.paused():
        assert stream.advances == 4
        for _ in range(100):
            stream.gate.release()
        time.sleep(0.1)
        assert stream.advances == 4  # held at the token boundary
        gen.version_box["v"] = 1  # type: ignore[attr-defined]
    done = _collect_all(gen, 4)
    gen.close()
    assert stream.changes == 1
    for request in done:
        assert isinstance(request, StreamRequest)
        assert request.versions == [0] * 4 + [1] * 2
    assert gen.metrics()["stream/interrupted_requests"] == 4
    assert gen.metrics()["stream/interrupted_requests"] == 0  # counted once, then reset


def test_without_partial_rollouts_the_load_waits_for_responses_under_way() -> None:
    stream = ScriptedStream()
    gen = _generator(stream, partial=False)
    gen.submit(_prompts(2), PARAMS, epoch=0)
    with gen.paused():
        gen.version_box["v"] = 1  # type: ignore[attr-defined]
    done = _collect_all(gen, 4)
    gen.close()
    for request in done:  # every response ended on the weights it started with
        assert isinstance(request, StreamRequest) and len(set(request.versions)) == 1


def test_whole_calls_run_each_submission_as_one_generate_call() -> None:
    stream = ScriptedStream()
    gen = _generator(stream, whole_calls=True)
    gen.version_box["v"] = 3  # type: ignore[attr-defined]
    gen.submit(_prompts(3), PARAMS, epoch=2)
    other = PARAMS.model_copy(update={"seed": 9})
    gen.submit(_prompts(1), other, epoch=2)
    done = _collect_all(gen, 2)
    gen.close()
    engine = gen.engine
    assert isinstance(engine, ScriptedEngine) and engine.calls == [PARAMS, other]
    assert stream.advances == 0
    first, second = done
    assert isinstance(first, FinishedRows) and isinstance(second, FinishedRows)
    assert first.keys == [(2, i, k) for i in range(3) for k in range(2)]
    assert len(first.rows) == 6 and len(second.rows) == 2
    versions = first.rows["token_versions"]
    assert set(versions[first.rows["attention_mask"][:, -6:].bool()].tolist()) == {3}


def test_a_failure_on_the_thread_reaches_collect_with_its_traceback() -> None:
    gen = _generator(ScriptedStream(fail_after=2))
    gen.submit(_prompts(1), PARAMS, epoch=0)
    with pytest.raises(StreamFailed, match="scripted decode failure") as raised:
        _collect_all(gen, 2)
    assert "Traceback" in str(raised.value)
    gen.close()
