"""The rollout worker of a standalone rollout pool (``placement.mode: standalone``).

The rollout engine (any backend) in processes of its own, so generation can run while the
actor trains (``rollout.max_staleness`` > 0, the trainer's asynchronous loop).  New weights
arrive between generate calls over the weight channel (:mod:`hf_core.sync.receiver`; a
streaming pool keeps decoding while they land and stops only for the swap); each rank is one
whole-model engine fed its share of the prompts (data parallel).  Every generated sample
carries ``rollout_version``: the policy version of the weights this rank held when it
generated it (its own record, kept when a weight stream was loaded), so tests and metrics
need not trust the trainer's schedule for it.
"""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.engines import Closeable, SamplingParams
from hf_core.engines.streaming import StreamRequest
from hf_core.plugins import get_rollout_engine
from hf_core.protocols import register
from hf_core.roles.common import build_agent_loop, rollout_engine_args, torch_threads
from hf_core.roles.rollout_stream import FinishedRows, StreamingGenerator
from hf_core.sync import BroadcastReceiver, ChannelAddress
from hf_core.sync.relay import node_key
from hf_core.worker import Worker

ROLLOUT_VERSION = "rollout_version"
"""Per generated sample: the policy version of the weights the rollout rank generated it with."""


class RolloutWorker(Worker):
    """One rank of the standalone rollout pool."""

    def __init__(self, config: TrainerConfig, layout: RunLayout) -> None:
        """``layout``: the run's layout as the driver resolved it."""
        super().__init__()
        torch.set_num_threads(torch_threads(config))
        self.config = config
        factory = get_rollout_engine(config.rollout.backend)
        generation = layout.generation
        self.rollout = factory(**rollout_engine_args(config, generation), **config.rollout.engine)
        self.receiver = BroadcastReceiver(
            self.rank,
            self.device,
            # a stream keeps generating while the weights land (a delta needs the copy anyway)
            staged=config.rollout.sync == "delta" or config.rollout.mode == "streaming",
            bucket_bytes=int(config.rollout.bucket_mb * 2**20),
        )
        # None: single-turn rollouts
        self.agent = build_agent_loop(
            config, generation, self.rollout, lambda: self.receiver.version
        )
        self.stream: StreamingGenerator | None = None

    @register("DP_PROTO")
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """This rank's share of the prompts, sampled with the weights it holds now (multi-turn
        with tools when the recipe has an ``agent:`` section), each tagged with the version of
        those weights (:data:`ROLLOUT_VERSION`).  A running stream waits meanwhile: the
        engine serves one caller at a time."""
        engine = self.agent or self.rollout
        if self.stream is not None:
            with self.stream.paused(weights_change=False):
                out = engine.generate(prompts, params)
        else:
            out = engine.generate(prompts, params)
        out[ROLLOUT_VERSION] = torch.full((len(out),), self.receiver.version, dtype=torch.int64)
        return out

    @register("RANK_ZERO")
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the pool's engines resolved to (``None``: the engine does not say)."""
        return getattr(self.rollout, "compute_dtype", None)

    @register("ONE_TO_ALL")
    def node_key(self) -> str:
        """This rank's node (the weight channel relays one copy per node)."""
        return node_key()

    @register("ONE_TO_ALL")
    def join_weight_channel(self, address: ChannelAddress) -> None:
        """Join the actor's broadcast group (blocks until every end joined)."""
        self.receiver.join(address)

    @register("ONE_TO_ALL")
    def receive_weights(self) -> dict[str, float]:
        """Load the actor's new weights; this rank's sync metrics.  A running stream goes on
        decoding while they arrive, pauses at a token boundary for the swap only, and
        continues on the new weights; ``sync/pool_idle_s`` is the time the engine could not
        generate."""
        if self.stream is None:
            metrics = self.receiver.receive(self.rollout)
            # the call held the engine from its start: waiting for the stream, then loading
            metrics["sync/pool_idle_s"] = metrics["sync/wait_s"] + metrics["perf/weight_sync_s"]
        else:
            metrics = self.receiver.receive(self.rollout, pause=self.stream.paused)
            metrics["sync/pool_idle_s"] = metrics["sync/swap_s"]
        return metrics

    # ------------------------------------------------------------ streaming
    @register("ONE_TO_ALL")
    def stream_open(
        self, capacity: int, chunk_tokens: int, interruptible: bool, partial: bool
    ) -> int:
        """Start this rank's generation thread (``rollout.mode: streaming``); the engine's
        padding token id (the trainer pads responses with it).  The agent loop, and any pool
        whose updates cannot come mid-generation (``interruptible=False``), run each
        submission as one call (:mod:`hf_core.roles.rollout_stream`)."""
        if self.stream is None:
            self.stream = StreamingGenerator(
                self.agent or self.rollout,
                lambda: self.receiver.version,
                capacity=capacity,
                chunk_tokens=chunk_tokens,
                whole_calls=self.agent is not None or not interruptible,
                partial=partial,
            )
        return int(getattr(self.rollout, "pad_token_id", 0) or 0)

    @register("ALL_TO_ALL")
    def stream_submit(self, work: tuple[Batch, SamplingParams, int] | None) -> None:
        """Queue prompts (with the sampling parameters and epoch they were drawn for)."""
        if work is not None:
            self._stream().submit(*work)

    @register("ONE_TO_ALL")
    def stream_collect(
        self, wait_s: float
    ) -> tuple[list[StreamRequest | FinishedRows], dict[str, float]]:
        """Samples finished since the last call (waiting up to ``wait_s`` for one) and the
        thread's idle / busy time since then."""
        stream = self._stream()
        done = stream.collect(wait_s)
        return done, stream.metrics()

    def _stream(self) -> StreamingGenerator:
        if self.stream is None:
            raise RuntimeError("stream_open was not called on this rollout rank")
        return self.stream

    @register("ONE_TO_ALL")
    def close(self) -> None:
        """Leave the channel and shut the engine down (a clean end of the run)."""
        if self.stream is not None:
            self.stream.close()
        self.receiver.close()
        if isinstance(self.rollout, Closeable):
            self.rollout.close()
