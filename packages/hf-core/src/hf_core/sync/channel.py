"""A collective channel between the actor and a standalone rollout pool, for weight messages.

With ``placement.mode: standalone`` the rollout engines run in processes of their own, so the
in-process hand-off of the hybrid engine is not available: after an update the actor's rank 0
sends the weights to every rollout rank as a stream of byte messages (what they mean is
:mod:`hf_core.sync.wire`'s business).  The channel is made for this alone (its own TCP store
and process groups, gloo on CPU and nccl on GPU), next to whatever default process group the
actor's training engine uses, so neither side's collectives can interleave with the other's.

Messages travel down a :class:`~hf_core.sync.relay.RelayTree`: the sender broadcasts each one
to one leader per node, and the leader forwards it to the rest of its node without holding
the sender up (the forward is queued on the node's group and waited for later).  After a
stream, :meth:`WeightChannel.agree` lets any rank raise a doubt (a delta it could not apply, a
checksum that did not match) that every rank, the sender included, then knows about.
Nothing is pickled; the extra memory on either side is about one message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_core.device import distributed_backend
from hf_core.sync.relay import RelayTree

SENDER = 0
"""The actor's rank 0 is rank 0 of the channel; rollout rank i is channel rank i + 1."""

JOIN_TIMEOUT_S = 300.0
"""How long either end waits for the other to join or to send (slow first syncs included)."""

RELAY_DEPTH = 4
"""Messages a leader may have queued on its node group before it waits for the oldest."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where the channel's TCP store listens (on the sender's node), and the node of each
    receiver (rollout rank order), from which every end derives the relay tree."""

    host: str
    port: int
    nodes: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.nodes) + 1


class WeightChannel:
    """One end of the actor -> rollout channel.

    The sender opens the store (:meth:`listen`), every rollout rank joins with the address
    (:meth:`connect`); constructing the groups waits until all their members are in.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        nodes: Sequence[str],
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.rank, self.device = rank, device
        self.tree = RelayTree.of(nodes)
        self.world_size = self.tree.world_size
        self._store = store  # kept alive: the groups' rendezvous live in it
        self._timeout = timedelta(seconds=timeout_s)
        trunk = self.tree.trunk
        # the trunk first: a node's followers wait for their leader, who waits for the sender
        self.trunk = self._group("trunk", trunk, rank) if rank in trunk else None
        local = self.tree.local(rank)
        self.local = None if local is None else self._group(self.tree.local_name(rank), local, rank)
        self.is_leader = self.tree.is_leader(rank)
        self._relaying: list[tuple[dist.Work, torch.Tensor]] = []

    def _group(self, name: str, members: list[int], rank: int) -> dist.ProcessGroup:
        prefixed = dist.PrefixStore(f"hf_weights/{name}", self._store)
        index, size = members.index(rank), len(members)
        if distributed_backend(self.device) == "nccl":
            return dist.ProcessGroupNCCL(prefixed, index, size)
        return dist.ProcessGroupGloo(prefixed, index, size, timeout=self._timeout)

    @staticmethod
    def listen(
        host: str, nodes: Sequence[str], timeout_s: float
    ) -> tuple[dist.TCPStore, ChannelAddress]:
        """The sender's store on a free port, and the address the receivers need."""
        store = dist.TCPStore(
            host,
            0,
            len(nodes) + 1,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        return store, ChannelAddress(host, store.port, tuple(nodes))

    @classmethod
    def connect(
        cls, address: ChannelAddress, rank: int, device: torch.device, timeout_s: float
    ) -> WeightChannel:
        """A receiver's end (``rank`` >= 1)."""
        store = dist.TCPStore(
            address.host,
            address.port,
            address.world_size,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        return cls(store, rank, address.nodes, device, timeout_s)

    # ------------------------------------------------------------ transfer
    @staticmethod
    def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0  # the sender in the trunk, the leader in a node group
        return group.broadcast([tensor], options)

    def post(self, payload: torch.Tensor | None) -> None:
        """Send one message (a uint8 tensor) to every receiver; ``None`` or an empty tensor
        ends a stream (receivers read an empty message)."""
        if self.rank != SENDER or self.trunk is None:
            raise RuntimeError("only the actor's rank 0 sends weights")
        length = 0 if payload is None else payload.numel()
        size = torch.tensor([length], dtype=torch.int64, device=self.device)
        self._broadcast(self.trunk, size).wait()
        if length:
            assert payload is not None
            self._broadcast(self.trunk, payload.to(self.device)).wait()

    def take(self) -> torch.Tensor:
        """The next message (empty: the stream ended); a leader also forwards it to its node."""
        if self.rank == SENDER:
            raise RuntimeError("the actor's rank 0 sends, it does not receive")
        source = self.trunk if self.is_leader else self.local
        assert source is not None
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(source, size).wait()
        length = int(size.item())
        message = torch.empty(length, dtype=torch.uint8, device=self.device)
        if length:
            self._broadcast(source, message).wait()
        if self.is_leader and self.local is not None:
            self._forward(size)
            if length:
                self._forward(message)
        return message

    def _forward(self, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` on the node group; wait only for what is :data:`RELAY_DEPTH` old."""
        assert self.local is not None
        self._relaying.append((self._broadcast(self.local, tensor), tensor))
        while len(self._relaying) > RELAY_DEPTH:
            self._relaying.pop(0)[0].wait()

    def _drain(self) -> None:
        while self._relaying:
            self._relaying.pop(0)[0].wait()

    def agree(self, doubt: bool) -> bool:
        """Whether any rank raised ``doubt``; every rank calls it after a stream and every
        rank gets the same answer (node groups reduce to their leader, the trunk reduces,
        the leaders tell their nodes)."""
        flag = torch.tensor([1 if doubt else 0], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        if self.is_leader:
            self._drain()
        if self.local is not None:
            self.local.allreduce([flag], options).wait()
        if self.trunk is not None:
            self.trunk.allreduce([flag], options).wait()
        if self.local is not None:
            self._broadcast(self.local, flag).wait()  # the leader's, after the trunk's
        return bool(flag.item())

    def close(self) -> None:
        """Drop the groups (their sockets close with them)."""
        self._relaying.clear()
        self.trunk = None
        self.local = None
