"""Streaming canonical weights in bounded buckets."""

from __future__ import annotations

import pytest
import torch

from hf_core.engines import iter_buckets, tensor_nbytes


def test_buckets_respect_the_byte_bound() -> None:
    stream = [(f"w{i}", torch.zeros(i + 1)) for i in range(10)]  # 4..40 bytes each
    buckets = list(iter_buckets(iter(stream), bucket_bytes=64))
    assert [name for bucket in buckets for name, _ in bucket] == [n for n, _ in stream]
    for bucket in buckets:
        size = sum(tensor_nbytes(t) for _, t in bucket)
        assert size <= 64 or len(bucket) == 1


def test_oversized_tensor_travels_alone() -> None:
    stream = [("small", torch.zeros(2)), ("big", torch.zeros(100)), ("tail", torch.zeros(2))]
    assert [[n for n, _ in b] for b in iter_buckets(stream, 16)] == [["small"], ["big"], ["tail"]]


def test_bucket_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        list(iter_buckets([], 0))


def test_stream_is_consumed_lazily() -> None:
    produced: list[str] = []

    def stream():
        for i in range(6):
            produced.append(f"w{i}")
            yield f"w{i}", torch.zeros(4)  # 16 bytes

    buckets = iter_buckets(stream(), bucket_bytes=32)
    first = next(buckets)
    assert [n for n, _ in first] == ["w0", "w1"]
    assert produced == ["w0", "w1", "w2"]  # one look-ahead tensor, not the whole model
