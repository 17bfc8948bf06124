"""The rollout pool's end of a broadcast sync: take the actor's stream, then load the weights.

Kept apart from the sending side (:mod:`hf_core.sync.broadcast`) because it runs in the pool's
processes, next to a rollout engine and no training engine.  It records the policy version of
the weights it loaded, the pool's own account of which weights generated each batch.

Two ways to load.  *Direct*: each bucket goes into the engine as it arrives (no extra memory;
the engine cannot generate meanwhile).  *Staged* (``rollout.sync: delta``, or a streaming
pool): the stream lands in a host copy of the weights while the engine goes on generating,
and only the swap -- copying the tensors that changed into the engine -- needs it to stop,
at a token boundary (``pause``).  The staged copy is also the mirror deltas apply to; it costs
one model in the pool's dtype (counted by the pre-start memory check).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from hf_core.engines import RolloutEngine
from hf_core.engines.weights import iter_buckets
from hf_core.sync.broadcast import SyncMismatch
from hf_core.sync.channel import JOIN_TIMEOUT_S, ChannelAddress, WeightChannel
from hf_core.sync.messages import ChecksumMismatch, StreamHead, WireStats
from hf_core.sync.wire import WireDecoder

Pause = Callable[[], AbstractContextManager[object]]
"""Holds the pool's generation at a token boundary for as long as the context is open."""


class _Stream:
    """One stream as this rank took it."""

    def __init__(self, head: StreamHead) -> None:
        self.head = head
        self.stats = WireStats()
        self.changed: dict[str, torch.Tensor] = {}
        self.doubt: str | None = None
        self.load_s = 0.0
        self.began = time.perf_counter()
        """When the head arrived (the sender started sending)."""


class BroadcastReceiver:
    """The rollout side: rollout rank ``i`` is channel rank ``i + 1``.

    ``staged``: land each stream in a host copy and load it in one swap (see the module);
    it is implied by ``delta`` (the copy is what deltas apply to).
    """

    def __init__(
        self,
        rank: int,
        device: torch.device,
        *,
        staged: bool = False,
        bucket_bytes: int = 64 * 2**20,
    ) -> None:
        self.rank, self.device = rank, device
        self.staged, self.bucket_bytes = staged, bucket_bytes
        self.decoder = WireDecoder(keep=staged)
        self.channel: WeightChannel | None = None
        self.version = 0
        """Policy version of the weights loaded into the engine (0: the initial weights it
        was built from, as the actor's); set only once a whole stream is loaded."""

    def join(self, address: ChannelAddress) -> None:
        self.channel = WeightChannel.connect(address, self.rank + 1, self.device, JOIN_TIMEOUT_S)

    def receive(self, rollout: RolloutEngine, pause: Pause = nullcontext) -> dict[str, float]:
        """Take the actor's stream (and the full one that answers any doubt), load the
        weights; this rank's sync metrics.  ``pause`` holds generation for the load."""
        if self.channel is None:
            raise RuntimeError("the weight channel from the actor is not joined")
        called = time.perf_counter()
        stream = self._take(self.channel, None if self.staged else rollout)
        start = stream.began
        healed = False
        if self.channel.agree(stream.doubt is not None):
            self._refuse_if_full(stream)
            stream = self._take(self.channel, None if self.staged else rollout)
            if self.channel.agree(stream.doubt is not None):
                self._refuse_if_full(stream)
            healed = True
        received = time.perf_counter()
        swap_s = 0.0
        if self.staged:
            with pause():
                began = time.perf_counter()
                for bucket in iter_buckets(stream.changed.items(), self.bucket_bytes):
                    rollout.load_weights(bucket)
                rollout.finish_weight_sync()
                swap_s = time.perf_counter() - began
        else:
            rollout.finish_weight_sync()
        self.version = stream.head.version
        metrics = {
            "perf/weight_sync_s": time.perf_counter() - start,
            "sync/wait_s": start - called,
            "reshard/bytes_received": float(stream.stats.model_bytes),
            "sync/bytes_received": float(stream.stats.bytes),
            "sync/receive_s": received - start,
            "sync/apply_s": stream.load_s + swap_s,
            "sync/swap_s": swap_s,
            "sync/healed": float(healed),
        }
        metrics.update(rollout.sync_metrics())
        return metrics

    def _take(self, channel: WeightChannel, direct: RolloutEngine | None) -> _Stream:
        """Take one stream to its end, applying what this rank can (loading it into
        ``direct`` as it comes, or into the staged copy); a stream it cannot apply is still
        read to the end, with the reason kept as its doubt."""
        head = StreamHead.read(channel.take())
        stream = _Stream(head)
        if not self.decoder.accepts(head):
            stream.doubt = f"a delta on version {head.base}, this rank holds {self.decoder.version}"
        while (message := channel.take()).numel():
            if stream.doubt is not None:
                continue
            if self.staged:
                message = message.cpu()
            try:
                tensors, counts = self.decoder.apply(message, head)
            except ChecksumMismatch as error:
                stream.doubt = str(error)
                continue
            stream.stats.add(counts)
            if direct is None:
                stream.changed.update(tensors)
            else:
                began = time.perf_counter()
                direct.load_weights(tensors)
                stream.load_s += time.perf_counter() - began
        if stream.doubt is None:
            self.decoder.finish(head)
        else:
            self.decoder.reset()
        return stream

    def _refuse_if_full(self, stream: _Stream) -> None:
        """A full stream that some rank doubted: nothing can heal it (every rank raises)."""
        if stream.head.full:
            reason = stream.doubt or "another rollout rank's checksums did not match"
            raise SyncMismatch(
                f"weight sync of version {stream.head.version}, rollout rank {self.rank}: {reason}"
            )

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
