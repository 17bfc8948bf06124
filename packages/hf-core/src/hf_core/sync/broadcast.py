"""Broadcast sync: the actor's weights to a rollout pool of its own (``standalone`` placement).

The rollout engines run in processes of their own, so the in-process hand-off of the hybrid
engine is not available: every actor rank exports (a sharded engine gathers each tensor
collectively) and rank 0 broadcasts every bucket over a :class:`~hf_core.sync.channel.WeightChannel`
to the pool, whose ranks load them as they arrive (:mod:`hf_core.sync.receiver`).  The
generation layout of a standalone pool is whole-model (``t_g = p_g = 1``), so by the paper's
accounting every rollout rank receives ``M / (t_g p_g) = M`` bytes per sync (it holds none of
the training shards); rank 0 reports ``M`` as ``reshard/model_bytes``.

Each broadcast carries the actor's update count (its policy version), so every batch the pool
generates can say which weights made it.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

from hf_core.engines import TrainingEngine
from hf_core.sync.channel import JOIN_TIMEOUT_S, SENDER, ChannelAddress, WeightChannel


def _node_address() -> str:
    """This node's address as other Ray nodes reach it."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (unit tests): the local host
        return socket.gethostbyname(socket.gethostname())


class BroadcastSync:
    """The actor side: rank 0 owns the channel's store and sends; other ranks only export.

    The channel is set up once (:meth:`listen` on rank 0, then :meth:`join` on every rank,
    with the pool's joins in flight) before the first :meth:`run`.
    """

    def __init__(
        self, actor: TrainingEngine, *, bucket_bytes: int, rank: int, device: torch.device
    ) -> None:
        self.actor, self.bucket_bytes = actor, bucket_bytes
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

    def run(self, version: int = 0) -> dict[str, float]:
        """Export on every rank, broadcast from rank 0 (the weights of policy ``version``);
        this rank's sync metrics."""
        start = time.perf_counter()
        buckets = self.actor.export_weights(self.bucket_bytes)
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
