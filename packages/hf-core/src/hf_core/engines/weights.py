"""The canonical weight format and the streaming helpers every backend shares.

Canonical = HuggingFace transformers state-dict names with full logical shapes.  A training
backend exports its parameters as canonical ``(name, tensor)`` pairs (a full tensor, or the
slice a reshard plan asks for); a rollout backend loads them.  Transfers go in buckets of a
bounded byte size so the extra memory of a weight sync is about one bucket, never a second
full model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

NamedTensor = tuple[str, torch.Tensor]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of its storage, which a view may share)."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(stream: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group a stream of named tensors into lists of at most ``bucket_bytes`` each.

    A tensor larger than the bucket travels alone.  The stream is consumed lazily, so at most
    one bucket of tensors produced by the stream is alive at a time.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in stream:
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass(frozen=True)
class CanonicalSlice:
    """A canonical tensor, or a block of one: ``tensor`` is ``full.narrow(dim, start, len)``.

    ``dim is None`` means the whole tensor.  This is what a resharding training engine yields
    (the 3D-HybridEngine's generation shard): a rollout engine that loads TP slices
    (:class:`~hf_core.engines.LoadsTPSlices`) copies each into its own shard; one that takes
    whole tensors gets only slices that are whole.
    """

    name: str
    tensor: torch.Tensor
    dim: int | None
    start: int
    full_shape: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.start + (self.tensor.shape[self.dim] if self.dim is not None else 0)

    @property
    def is_full(self) -> bool:
        return self.dim is None or tuple(self.tensor.shape) == self.full_shape

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class WeightMapping(ABC):
    """A backend's translation between its own parameters and canonical HF tensors.

    Each backend owns one: FSDP's is mostly the identity (it trains HF modules), megatron's
    fuses QKV and gate/up and splits along TP dims, a rollout engine may fuse on load.
    """

    @abstractmethod
    def to_canonical(self, native: Mapping[str, torch.Tensor]) -> Iterator[NamedTensor]:
        """Yield canonical ``(hf_name, tensor)`` pairs for the backend's native tensors."""

    @abstractmethod
    def from_canonical(self, canonical: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
        """Yield the backend's native ``(name, tensor)`` pairs for canonical tensors."""
