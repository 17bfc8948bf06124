"""Broadcast sync: the actor's weights to a rollout pool of its own (``standalone`` placement).

The rollout engines run in processes of their own, so the in-process hand-off of the hybrid
engine is not available: every actor rank exports (a sharded engine gathers each tensor
collectively) and rank 0 sends every bucket over a :class:`~hf_core.sync.channel.WeightChannel`
to the pool (one copy per node, relayed on the node), whose ranks apply them as they arrive
(:mod:`hf_core.sync.receiver`).  With ``rollout.sync: delta`` only the entries that changed
since the last version travel (:mod:`hf_core.sync.wire`).  The generation layout of a
standalone pool is whole-model (``t_g = p_g = 1``), so by the paper's accounting every rollout
rank receives ``M / (t_g p_g) = M`` bytes of weights per sync (it holds none of the training
shards); rank 0 reports ``M`` as ``reshard/model_bytes``, and what really crossed the wire as
``sync/bytes_sent``.

Each stream carries the actor's update count (its policy version), so every batch the pool
generates can say which weights made it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from hf_core.engines import NamedTensor, TrainingEngine
from hf_core.sync.channel import JOIN_TIMEOUT_S, SENDER, ChannelAddress, WeightChannel
from hf_core.sync.messages import StreamHead, WireStats
from hf_core.sync.wire import WireEncoder


def _node_address() -> str:
    """This node's address as other Ray nodes reach it."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (unit tests): the local host
        return socket.gethostbyname(socket.gethostname())


class SyncMismatch(RuntimeError):
    """A rollout rank's weights did not match the sender's after a full sync."""


class BroadcastSync:
    """The actor side: rank 0 owns the channel's store and sends; other ranks only export.

    The channel is set up once (:meth:`listen` on rank 0, then :meth:`join` on every rank,
    with the pool's joins in flight) before the first :meth:`run`.  ``encoder`` says what
    goes on the wire (full or delta, in which dtype).
    """

    def __init__(
        self,
        actor: TrainingEngine,
        *,
        bucket_bytes: int,
        rank: int,
        device: torch.device,
        encoder: WireEncoder | None = None,
    ) -> None:
        self.actor, self.bucket_bytes = actor, bucket_bytes
        self.rank, self.device = rank, device
        self.encoder = encoder or WireEncoder()
        self._store: dist.TCPStore | None = None
        self._address: ChannelAddress | None = None
        self.channel: WeightChannel | None = None

    def listen(self, nodes: Sequence[str]) -> ChannelAddress:
        """Open the store for rollout ranks on ``nodes`` (one node key each; rank 0 only).
        A new pool holds none of the chain: the first sync is full."""
        self.encoder.reset()
        self._store, self._address = WeightChannel.listen(_node_address(), nodes, JOIN_TIMEOUT_S)
        return self._address

    def join(self) -> None:
        """Form the groups with the rollout ranks (blocks until they all joined)."""
        if self.rank != SENDER:
            return
        if self._store is None or self._address is None:
            raise RuntimeError("listen() first: the weight channel has no store")
        self.channel = WeightChannel(
            self._store, SENDER, self._address.nodes, self.device, JOIN_TIMEOUT_S
        )

    def restart_chain(self) -> None:
        """The actor's weights were replaced (a checkpoint restore): the next sync is full."""
        self.encoder.reset()

    def run(self, version: int = 0) -> dict[str, float]:
        """Export on every rank, send from rank 0 (the weights of policy ``version``); this
        rank's sync metrics."""
        start = time.perf_counter()
        buckets = self.actor.export_weights(self.bucket_bytes)
        if self.rank != SENDER:
            for _ in buckets:  # the export's collectives need every rank
                pass
            return {"perf/weight_sync_s": time.perf_counter() - start}
        if self.channel is None:
            raise RuntimeError("the weight channel to the rollout pool is not joined")
        head = self.encoder.head(version)
        timing = {"export": 0.0, "transfer": 0.0}
        stats = self._stream(self.channel, head, buckets, timing)
        healed = self._settle(self.channel, head, stats, timing)
        return {
            "perf/weight_sync_s": time.perf_counter() - start,
            "reshard/model_bytes": float(stats.model_bytes),
            "sync/bytes_sent": float(stats.bytes),
            "sync/changed_fraction": stats.changed_fraction,
            "sync/full": float(head.full),
            "sync/healed": float(healed),
            "sync/export_s": timing["export"],
            "sync/transfer_s": timing["transfer"],
        }

    def _stream(
        self,
        channel: WeightChannel,
        head: StreamHead,
        buckets: Iterable[list[NamedTensor]],
        timing: dict[str, float],
    ) -> WireStats:
        """Send one stream: the head, each bucket's message, the end."""
        stats = WireStats()
        channel.post(head.message())
        iterator = iter(buckets)
        while True:
            began = time.perf_counter()
            bucket = next(iterator, None)
            if bucket is None:
                break
            message, counts = self.encoder.encode(bucket, head)
            sent = time.perf_counter()
            timing["export"] += sent - began
            channel.post(message)
            timing["transfer"] += time.perf_counter() - sent
            stats.add(counts)
        channel.post(None)
        return stats

    def _settle(
        self, channel: WeightChannel, head: StreamHead, stats: WireStats, timing: dict[str, float]
    ) -> bool:
        """Hear the receivers' doubts about ``head``'s stream; heal a doubted delta with a
        full sync from the mirror.  Whether it healed."""
        began = time.perf_counter()
        doubt = channel.agree(False)
        timing["transfer"] += time.perf_counter() - began
        self.encoder.finish(head)
        if not doubt:
            return False
        if head.full:
            raise SyncMismatch(
                f"weight sync of version {head.version}: a rollout rank's weights do not match "
                "the sent ones after a full sync (checksums differ)"
            )
        heal = StreamHead(head.version, None, verify=True)
        healing = self._stream(
            channel, heal, self.encoder.mirror_buckets(self.bucket_bytes), timing
        )
        stats.bytes += healing.bytes
        if channel.agree(False):
            raise SyncMismatch(
                f"weight sync of version {head.version}: a rollout rank still disagrees after "
                "the full sync that answered its doubt"
            )
        self.encoder.finish(heal)
        return True

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self._store = None
