"""The rollout pool's end of a broadcast sync: load the actor's buckets as they arrive.

Kept apart from the sending side (:mod:`hf_core.sync.broadcast`) because it runs in the pool's
processes, next to a rollout engine and no training engine.  It records the policy version of
the weights it loaded, the pool's own account of which weights generated each batch.
"""

from __future__ import annotations

import time

import torch

from hf_core.engines import RolloutEngine
from hf_core.sync.channel import JOIN_TIMEOUT_S, ChannelAddress, WeightChannel


class BroadcastReceiver:
    """The rollout side: rollout rank ``i`` is channel rank ``i + 1``."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.channel: WeightChannel | None = None
        self.version = 0
        """Policy version of the weights loaded into the engine (0: the initial weights it
        was built from, as the actor's); set only once a whole broadcast is loaded."""

    def join(self, address: ChannelAddress) -> None:
        self.channel = WeightChannel.connect(address, self.rank + 1, self.device, JOIN_TIMEOUT_S)

    def receive(self, rollout: RolloutEngine) -> dict[str, float]:
        """Load every bucket as it arrives; this rank's sync metrics."""
        if self.channel is None:
            raise RuntimeError("the weight channel from the actor is not joined")
        start = time.perf_counter()
        received = 0
        version, buckets = self.channel.receive()
        for bucket in buckets:
            received += sum(t.numel() * t.element_size() for _, t in bucket)
            rollout.load_weights(bucket)
        rollout.finish_weight_sync()
        self.version = version
        metrics = {
            "perf/weight_sync_s": time.perf_counter() - start,
            "reshard/bytes_received": float(received),
        }
        metrics.update(rollout.sync_metrics())
        return metrics

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
