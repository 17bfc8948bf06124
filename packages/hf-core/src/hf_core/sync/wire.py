"""What a weight sync to a rollout pool sends: whole tensors, or only the entries that changed.

After one optimizer step at RL learning rates most half-precision weights do not change at
all (the update is below the format's resolution), so a *delta* sync sends, per tensor, the
positions and new values of the entries whose bits changed -- or a bit mask of them and their
values where many changed, or the whole tensor where most did, or nothing where none did.
Both ends keep the last version they sent / received (the *mirror*, in the pool's dtype, on
the host), the receivers apply each delta to theirs, and the result is bit for bit what a full
sync would have sent (entries are compared and copied as bits, never as numbers).

Drift cannot accumulate: a delta names its base version and a receiver that holds another one
(it missed a delta, it rejoined) raises a doubt, which the sender answers with a full sync
from its mirror; full syncs come every ``full_every`` versions anyway and carry a CRC-32 per
tensor, which the receivers check (deltas carry them in verify mode).  The messages
themselves are :mod:`hf_core.sync.messages`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy
import torch

from hf_core.engines import NamedTensor
from hf_core.engines.weights import iter_buckets
from hf_core.sync.messages import (
    ChecksumMismatch,
    StreamHead,
    WireStats,
    aligned,
    as_bytes,
    bits,
    bucket_message,
    checksum,
    dtype_named,
    padded,
    read_bucket,
)

Encoding = Literal["dense", "sparse", "mask", "same"]
"""A tensor's entry: its whole bytes, the changed entries' positions and values, a bit per
entry and the changed values, or nothing."""

WORTH_ENCODING = 0.75
"""A tensor's delta is sent as positions or a mask only below this share of its whole bytes:
above it, gathering the changed values (a boolean index over the tensor) costs the sender
more host time than the bytes it saves (measured: 2.3 s against 0.7 s for a 136M-entry
tensor with 87% of entries changed)."""


def _index_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.int32 if tensor.numel() < 2**31 else torch.int64


def _changed(tensor: torch.Tensor, previous: torch.Tensor) -> numpy.ndarray:
    """Per entry (flat), whether its bits differ from ``previous``'s (host tensors; numpy's
    compare, count and boolean indexing run several times faster than torch's here)."""
    return numpy.not_equal(bits(tensor).numpy(), bits(previous).numpy())


@dataclass
class WireEncoder:
    """The sender's end: turns exported buckets into bucket messages.

    ``delta``: keep a mirror and send deltas between full syncs (every ``full_every``
    versions); ``wire_dtype``: wider floating tensors travel in it (the pool's compute dtype,
    which its engine would round them to: the same rounding, half the bytes);
    ``verify``: deltas carry checksums too.
    """

    delta: bool = False
    full_every: int = 10
    verify: bool = False
    wire_dtype: torch.dtype | None = None
    mirror: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int | None = None
    """Version of the weights in the mirror (None: no mirror, the next sync is full)."""
    last_full: int | None = None

    def head(self, version: int) -> StreamHead:
        """The next stream's head: a delta on the mirror where one is allowed.  Full syncs of
        a delta chain carry checksums (they are where drift would show); plain full syncs
        only in verify mode (nothing accumulates, and hashing every tensor costs host time)."""
        due = self.last_full is None or version - self.last_full >= self.full_every
        if not self.delta or self.version is None or due:
            return StreamHead(version, None, verify=self.delta or self.verify)
        return StreamHead(version, self.version, verify=self.verify)

    def reset(self) -> None:
        """Forget the mirror (a checkpoint restore, a doubt): the next sync is full."""
        self.mirror.clear()
        self.version = None

    def wire(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        narrower = self.wire_dtype is not None and self.wire_dtype.itemsize < tensor.element_size()
        if narrower and tensor.is_floating_point():
            tensor = tensor.to(self.wire_dtype)
        if self.delta:
            tensor = tensor.cpu()
        return tensor.contiguous()

    def encode(
        self, bucket: Iterable[NamedTensor], head: StreamHead
    ) -> tuple[torch.Tensor, WireStats]:
        """One bucket's message under ``head``, and its counts; the mirror follows."""
        entries: list[dict[str, object]] = []
        parts: list[torch.Tensor] = []
        stats = WireStats()
        for name, exported in bucket:
            tensor = self.wire(exported)
            entry: dict[str, object] = {
                "name": name,
                "dtype": str(tensor.dtype),
                "shape": list(tensor.shape),
            }
            previous = self.mirror.get(name) if self.delta else None
            if previous is not None and (
                previous.shape != tensor.shape or previous.dtype != tensor.dtype
            ):
                previous = None
            mask = None if previous is None else _changed(tensor, previous)
            count = tensor.numel() if mask is None else int(numpy.count_nonzero(mask))
            payload = self._payload(tensor, mask, count, full=head.full)
            entry["encoding"], part = payload
            entry["count"] = count
            entry["payload"] = part.numel()
            if head.verify:
                entry["crc"] = checksum(tensor)
            if part.numel():
                parts.append(part)
            if self.delta:
                if previous is None:
                    self.mirror[name] = tensor.clone()
                else:
                    previous.copy_(tensor)
            entries.append(entry)
            stats.elements += tensor.numel()
            stats.model_bytes += tensor.numel() * tensor.element_size()
            stats.changed += count
            stats.tensors += 1
        message = bucket_message(entries, parts)
        stats.bytes = message.numel()
        return message, stats

    @staticmethod
    def _payload(
        tensor: torch.Tensor, mask: numpy.ndarray | None, count: int, *, full: bool
    ) -> tuple[Encoding, torch.Tensor]:
        """The smallest encoding of ``tensor`` given the ``mask`` of entries that changed:
        nothing, positions + values (few changes), a bit mask + values (many), or whole
        (most; see :data:`WORTH_ENCODING`)."""
        dense = as_bytes(tensor)
        if full or mask is None:
            return "dense", dense
        if count == 0:
            return "same", dense[:0]
        values = count * tensor.element_size()
        index_dtype = _index_dtype(tensor)
        sizes = {
            "sparse": padded(count * index_dtype.itemsize) + values,
            "mask": padded(-(-tensor.numel() // 8)) + values,
        }
        encoding = min(sizes, key=sizes.__getitem__)
        if sizes[encoding] > WORTH_ENCODING * dense.numel():
            return "dense", dense  # gathering the changed values costs more than it saves
        changed_values = as_bytes(torch.from_numpy(bits(tensor).numpy()[mask]))
        if encoding == "sparse":
            positions = torch.from_numpy(numpy.flatnonzero(mask)).to(index_dtype)
            return "sparse", torch.cat([*aligned(as_bytes(positions)), changed_values])
        packed = torch.from_numpy(numpy.packbits(mask))
        return "mask", torch.cat([*aligned(packed), changed_values])

    def finish(self, head: StreamHead) -> None:
        """The stream of ``head`` was delivered: the mirror holds its version."""
        if self.delta:
            self.version = head.version
        if head.full:
            self.last_full = head.version

    def mirror_buckets(self, bucket_bytes: int) -> Iterator[list[NamedTensor]]:
        """The mirror in buckets (a full sync without another export: healing a doubt)."""
        return iter_buckets(self.mirror.items(), bucket_bytes)


@dataclass
class WireDecoder:
    """A receiver's end: applies bucket messages.

    ``keep``: hold every tensor (the mirror a delta applies to; the staged weights a swap
    loads later).  Without it each bucket's tensors are only handed back, for loading now.
    """

    keep: bool = False
    mirror: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int | None = None

    def accepts(self, head: StreamHead) -> bool:
        """Whether this end can apply the stream: a delta needs the mirror at its base."""
        return head.full or (self.keep and self.version == head.base)

    def apply(self, message: torch.Tensor, head: StreamHead) -> tuple[list[NamedTensor], WireStats]:
        """One bucket message: the tensors it changed (new values), and its counts; raises
        :class:`ChecksumMismatch` where a checksum does not match."""
        changed: list[NamedTensor] = []
        stats = WireStats(bytes=message.numel())
        for entry, payload in read_bucket(message):
            name = str(entry["name"])
            dtype = dtype_named(str(entry["dtype"]))
            shape = [int(d) for d in entry["shape"]]  # type: ignore[attr-defined]
            encoding = entry["encoding"]
            stats.tensors += 1
            stats.elements += int(torch.Size(shape).numel())
            stats.model_bytes += int(torch.Size(shape).numel()) * dtype.itemsize
            stats.changed += int(entry["count"])  # type: ignore[call-overload]
            if encoding == "dense":
                tensor = payload.view(dtype).reshape(shape)
                if self.keep:
                    self.mirror[name] = tensor
            else:
                tensor = self._patched(name, encoding, payload, int(entry["count"]))  # type: ignore[call-overload]
            if "crc" in entry and checksum(tensor) != entry["crc"]:
                raise ChecksumMismatch(
                    f"{name}: checksum mismatch after the sync of version {head.version}"
                )
            if encoding != "same":
                changed.append((name, tensor))
        return changed, stats

    def _patched(
        self, name: str, encoding: object, payload: torch.Tensor, count: int
    ) -> torch.Tensor:
        tensor = self.mirror.get(name)
        if tensor is None:
            raise ChecksumMismatch(f"{name}: a delta for a tensor this end does not hold")
        flat = bits(tensor)
        if encoding == "sparse":
            index_dtype = _index_dtype(tensor)
            split = padded(count * index_dtype.itemsize)
            positions = payload[:split].view(index_dtype)[:count].long()
            flat[positions] = payload[split:].view(flat.dtype)
        elif encoding == "mask":
            split = padded(-(-tensor.numel() // 8))
            unpacked = numpy.unpackbits(payload[:split].numpy(), count=tensor.numel())
            flat.numpy()[unpacked.view(bool)] = payload[split:].view(flat.dtype).numpy()
        return tensor

    def finish(self, head: StreamHead) -> None:
        self.version = head.version

    def reset(self) -> None:
        self.mirror.clear()
        self.version = None
