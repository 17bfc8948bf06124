"""A collective group between the actor and a standalone rollout pool, for weight broadcasts.

With ``placement.mode: standalone`` the rollout engines run in processes of their own, so the
in-process hand-off of the hybrid engine is not available: after an update the actor's rank 0
broadcasts the canonical weights, bucket by bucket, to every rollout rank.  The group is made
for this alone (its own TCP store and process group, gloo on CPU and nccl on GPU), next to
whatever default process group the actor's training engine uses, so neither side's
collectives can interleave with the other's.

Each broadcast starts with the policy version of the weights (the actor's update count), so
the rollout side knows which weights it holds; then each bucket travels as one flat byte
buffer preceded by a JSON header (names, dtypes, shapes); nothing is pickled.  The extra
memory on either side is about one bucket.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_core.device import distributed_backend
from hf_core.engines import NamedTensor

SENDER = 0
"""The actor's rank 0 is rank 0 of the channel; rollout rank i is channel rank i + 1."""

JOIN_TIMEOUT_S = 300.0
"""How long either end waits for the other to join or to send (slow first syncs included)."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where the channel's TCP store listens (on the sender's node)."""

    host: str
    port: int
    world_size: int


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight channel: unknown dtype {name!r} in a bucket header")
    return dtype


class WeightChannel:
    """One end of the actor -> rollout broadcast group.

    The sender opens the store (:meth:`listen`), every rollout rank joins with the address
    (:meth:`connect`); constructing the process group waits until all ``world_size`` ends are in.
    """

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self._store = store  # kept alive: the group's rendezvous lives in it
        prefixed = dist.PrefixStore("hf_weights", store)
        if distributed_backend(device) == "nccl":
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            self.group = dist.ProcessGroupGloo(
                prefixed, rank, world_size, timeout=timedelta(seconds=timeout_s)
            )

    @staticmethod
    def listen(
        host: str, world_size: int, timeout_s: float
    ) -> tuple[dist.TCPStore, ChannelAddress]:
        """The sender's store on a free port, and the address the receivers need."""
        store = dist.TCPStore(
            host,
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        return store, ChannelAddress(host, store.port, world_size)

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
        return cls(store, rank, address.world_size, device, timeout_s)

    # ------------------------------------------------------------ transfer
    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = SENDER
        self.group.broadcast([tensor], options).wait()

    def _broadcast_bytes(self, payload: torch.Tensor | None) -> torch.Tensor:
        """The sender's uint8 buffer on every end (the sender passes it, receivers ``None``);
        an empty buffer ends the stream."""
        length = 0 if payload is None else payload.numel()
        size = torch.tensor([length], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        length = int(size.item())
        if length == 0:
            return torch.empty(0, dtype=torch.uint8)
        if payload is None:
            buffer = torch.empty(length, dtype=torch.uint8, device=self.device)
        else:
            buffer = payload.to(self.device)
        self._broadcast(buffer)
        return buffer

    def send(self, buckets: Iterable[list[NamedTensor]], version: int) -> int:
        """Broadcast the weights' policy ``version``, every bucket, then the end marker;
        returns the weight bytes sent."""
        if self.rank != SENDER:
            raise RuntimeError("only the actor's rank 0 sends weights")
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        sent = 0
        for bucket in buckets:
            names = [name for name, _ in bucket]
            tensors = [t.detach().contiguous() for _, t in bucket]
            header = [[n, str(t.dtype), list(t.shape)] for n, t in zip(names, tensors, strict=True)]
            encoded = json.dumps(header).encode()
            self._broadcast_bytes(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
            flat = torch.cat([t.reshape(-1).view(torch.uint8).to(self.device) for t in tensors])
            self._broadcast_bytes(flat)
            sent += flat.numel()
        self._broadcast_bytes(None)
        return sent

    def receive(self) -> tuple[int, Iterator[list[NamedTensor]]]:
        """The policy version of the weights on their way (read now), and the sender's
        buckets, in order, as canonical (name, tensor) pairs (read as iterated)."""
        if self.rank == SENDER:
            raise RuntimeError("the actor's rank 0 sends, it does not receive")
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(version)
        return int(version.item()), self._buckets()

    def _buckets(self) -> Iterator[list[NamedTensor]]:
        while True:
            header_bytes = self._broadcast_bytes(None)
            if header_bytes.numel() == 0:
                return
            header = json.loads(header_bytes.cpu().numpy().tobytes().decode())
            flat = self._broadcast_bytes(None)
            bucket: list[NamedTensor] = []
            offset = 0
            for name, dtype_name, shape in header:
                dtype = _dtype(dtype_name)
                count = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
                raw = flat[offset : offset + count]
                bucket.append((name, raw.view(dtype).reshape(shape)))
                offset += count
            yield bucket

    def close(self) -> None:
        """Drop the group (its sockets close with it)."""
        del self.group
