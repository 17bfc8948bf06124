"""Weight sync into a standalone rollout pool (``placement.mode: standalone``).

The two ends of :class:`~hf_core.roles.weight_channel.WeightChannel` as the role workers use
them.  The actor's ranks all export (a sharded engine gathers each tensor collectively) and
rank 0 broadcasts every bucket; each rollout rank loads the buckets into its engine as they
arrive.  The generation layout of a standalone pool is whole-model (``t_g = p_g = 1``), so by
the paper's accounting every rollout rank receives ``M / (t_g p_g) = M`` bytes per sync (it
holds none of the training shards); ``reshard/bytes_expected`` states that figure and
``reshard/bytes_received`` what the rank measured.

Each broadcast carries the actor's update count (its policy version); a rollout rank records
it once the weights are loaded, so every batch it generates can say which weights made it --
the engine's own account, next to the version the trainer's schedule expects.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

from hf_core.engines import RolloutEngine, TrainingEngine
from hf_core.roles.weight_channel import SENDER, ChannelAddress, WeightChannel

JOIN_TIMEOUT_S = 300.0
"""How long either end waits for the other to join or to send (slow first syncs included)."""


def _node_address() -> str:
    """This node's address as other Ray nodes reach it."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (unit tests): the local host
        return socket.gethostbyname(socket.gethostname())


class WeightSender:
    """The actor side: rank 0 owns the channel's store and sends; other ranks only export."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self._store: dist.TCPStore | None = None
        self._address: ChannelAddress | None = None
        self.channel: WeightChannel | None = None

    def listen(self, receivers: int) -> ChannelAddress:
        """Open the store for ``receivers`` rollout ranks (rank 0 only)."""
        self._store, self._address = WeightChannel.listen(
            _node_address(), receivers + 1, JOIN_TIMEOUT_S
        )
        return self._address

    def join(self) -> None:
        """Form the group with the rollout ranks (blocks until they all joined)."""
        if self.rank != SENDER:
            return
        if self._store is None or self._address is None:
            raise RuntimeError("listen() first: the weight channel has no store")
        self.channel = WeightChannel(
            self._store, SENDER, self._address.world_size, self.device, JOIN_TIMEOUT_S
        )

    def send(self, actor: TrainingEngine, bucket_bytes: int, version: int) -> dict[str, float]:
        """Export on every rank, broadcast from rank 0 (the weights of policy ``version``);
        this rank's sync metrics."""
        start = time.perf_counter()
        buckets = actor.export_weights(bucket_bytes)
        if self.rank != SENDER:
            for _ in buckets:  # the export's collectives need every rank
                pass
            return {"perf/weight_sync_s": time.perf_counter() - start}
        if self.channel is None:
            raise RuntimeError("the weight channel to the rollout pool is not joined")
        sent = self.channel.send(buckets, version)
        return {
            "perf/weight_sync_s": time.perf_counter() - start,
            "weight_sync/bytes_sent": float(sent),
            "reshard/model_bytes": float(sent),
        }

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self._store = None


class WeightReceiver:
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
