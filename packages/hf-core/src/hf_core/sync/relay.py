"""Who forwards the actor's weights to whom: one copy per node, then a relay on the node.

A broadcast from one sender to every rollout rank costs the sender more as ranks are added
(gloo's broadcast sends from the root to each rank in turn; across nodes every rank's bytes
cross the sender's link).  A :class:`RelayTree` sends the bytes once per *node*: the sender's
*trunk* group holds it and one *leader* per node (the node's first rollout rank); each leader
forwards what it receives to the rest of its node in a *local* group, while the sender goes on
with the next message.  The sender's time then follows the number of nodes, not of ranks.

Channel ranks: the sender is 0, rollout rank ``i`` is ``i + 1``.  Topology only, no torch.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RelayTree:
    """The groups of a channel whose receivers sit on ``nodes`` (one node key per receiver,
    rollout rank order; equal keys: the same node)."""

    nodes: tuple[str, ...]

    @classmethod
    def of(cls, nodes: Sequence[str]) -> RelayTree:
        if not nodes:
            raise ValueError("a weight channel needs at least one receiver")
        return cls(tuple(nodes))

    @property
    def world_size(self) -> int:
        return len(self.nodes) + 1

    def node_ranks(self) -> dict[str, list[int]]:
        """Channel ranks per node, in order of the node's first receiver."""
        by_node: dict[str, list[int]] = {}
        for index, node in enumerate(self.nodes):
            by_node.setdefault(node, []).append(index + 1)
        return by_node

    @property
    def trunk(self) -> list[int]:
        """The sender and each node's leader (its group's rank order)."""
        return [0] + [ranks[0] for ranks in self.node_ranks().values()]

    def local(self, rank: int) -> list[int] | None:
        """The node group of channel rank ``rank`` (its leader first); ``None`` for the sender
        and for a node with one receiver (nothing to relay)."""
        if rank == 0:
            return None
        ranks = self.node_ranks()[self.nodes[rank - 1]]
        return ranks if len(ranks) > 1 else None

    def local_name(self, rank: int) -> str:
        """A name for ``rank``'s node group, the same on every member (its leader's rank)."""
        group = self.local(rank)
        if group is None:
            raise ValueError(f"channel rank {rank} is in no node group")
        return f"node{group[0]}"

    def is_leader(self, rank: int) -> bool:
        return rank != 0 and rank in self.trunk


def node_key() -> str:
    """This process's node: Ray's node id (two Ray nodes on one host are two nodes), the host
    name outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except ImportError:
        pass
    return socket.gethostname()
