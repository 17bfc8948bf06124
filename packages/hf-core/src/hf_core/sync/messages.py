"""The weight channel's messages: a stream's head, bucket messages and their payloads.

A stream is one head message (:class:`StreamHead`: the version, the version a delta applies
to, whether checksums follow), one message per bucket (:func:`bucket_message`: an 8-byte
header length, a JSON header -- names, dtypes, shapes, encodings, checksums; nothing pickled
-- and the payloads, each aligned to :data:`ALIGN` bytes so it views as any dtype), and an
empty message.  What the payloads encode is :mod:`hf_core.sync.wire`'s business.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

ALIGN = 8
"""Byte alignment of every payload in a bucket message."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ChecksumMismatch(RuntimeError):
    """A tensor's bytes after a sync differ from the sender's."""


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in a bucket header")
    return dtype


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s entries as same-sized integers, flat: compared and copied bit for bit."""
    return tensor.reshape(-1).view(_BITS[tensor.element_size()])


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (on the host)."""
    return zlib.crc32(as_bytes(tensor.detach().cpu()).numpy())


@dataclass(frozen=True)
class StreamHead:
    """What a stream carries: the weights of policy ``version``, whole (``base`` None) or as
    a delta on ``base``; ``verify``: every tensor has a checksum."""

    version: int
    base: int | None
    verify: bool

    @property
    def full(self) -> bool:
        return self.base is None

    def message(self) -> torch.Tensor:
        encoded = json.dumps({"version": self.version, "base": self.base, "verify": self.verify})
        return torch.frombuffer(bytearray(encoded.encode()), dtype=torch.uint8)

    @classmethod
    def read(cls, message: torch.Tensor) -> StreamHead:
        data = json.loads(message.cpu().numpy().tobytes().decode())
        return cls(int(data["version"]), data["base"], bool(data["verify"]))


@dataclass
class WireStats:
    """One stream's counts (the sender's, or what a receiver applied)."""

    bytes: int = 0
    """Message bytes (what crossed the wire)."""
    model_bytes: int = 0
    """Bytes of the tensors the stream describes, whole (the weights' content)."""
    elements: int = 0
    changed: int = 0
    """Entries whose bits changed (every entry where there was nothing to compare with)."""
    tensors: int = 0

    def add(self, other: WireStats) -> None:
        self.bytes += other.bytes
        self.model_bytes += other.model_bytes
        self.elements += other.elements
        self.changed += other.changed
        self.tensors += other.tensors

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def padded(size: int) -> int:
    """``size`` rounded up to :data:`ALIGN` (payloads start aligned, so they view as any dtype)."""
    return -(-size // ALIGN) * ALIGN


def aligned(part: torch.Tensor) -> list[torch.Tensor]:
    pad = padded(part.numel()) - part.numel()
    return [part] if not pad else [part, part.new_zeros(pad)]


def bucket_message(entries: list[dict[str, object]], parts: list[torch.Tensor]) -> torch.Tensor:
    """One bucket: an 8-byte header length, the JSON header (``entries``), the payloads, each
    padded to :data:`ALIGN` bytes."""
    header = json.dumps(entries).encode()
    header += b" " * (padded(len(header)) - len(header))
    length = torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8)
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    device = parts[0].device if parts else head.device
    pieces = [length.to(device), head.to(device)]
    for part in parts:
        pieces.extend(aligned(part))
    return torch.cat(pieces)


def read_bucket(message: torch.Tensor) -> Iterator[tuple[dict[str, object], torch.Tensor]]:
    """(header entry, its payload bytes) per tensor of a :func:`bucket_message`."""
    length = int(message[:8].cpu().view(torch.int64).item())
    entries = json.loads(message[8 : 8 + length].cpu().numpy().tobytes().decode())
    offset = 8 + length
    for entry in entries:
        size = int(entry["payload"])
        yield entry, message[offset : offset + size]
        offset += padded(size)
