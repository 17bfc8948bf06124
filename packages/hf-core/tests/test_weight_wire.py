"""Delta weight sync (hf_core.sync.wire): the receiver's weights equal a full sync's, bit for
bit, and a broken version chain or a corrupted copy is detected (and, over the channel,
healed by a full sync)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hf_core.engines import NamedTensor
from hf_core.sync import BroadcastReceiver, BroadcastSync, WireDecoder, WireEncoder
from hf_core.sync.wire import ChecksumMismatch, StreamHead, bits, checksum, read_bucket

BUCKET = 4096


def _model(seed: int = 0, vocab: int = 64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(vocab, 32, generator=generator) * 0.02,
        "layer.0.weight": torch.randn(32, 32, generator=generator) * 0.02,
        "layer.0.bias": torch.zeros(32),
        "norm.weight": torch.ones(32),
        "steps": torch.tensor([3], dtype=torch.int64),
        "odd": torch.randn(7, generator=generator).double(),
    }


def _step(weights: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    """An Adam-like update: every float entry moves by about ``lr``."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in weights.values():
        if tensor.is_floating_point():
            tensor.add_(
                torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype).sign() * lr
            )


def _buckets(weights: dict[str, torch.Tensor]) -> list[list[NamedTensor]]:
    items = list(weights.items())
    return [items[:2], items[2:]]


def _sync(
    encoder: WireEncoder, decoder: WireDecoder, weights: dict[str, torch.Tensor], version: int
) -> StreamHead:
    head = encoder.head(version)
    assert decoder.accepts(head)
    for bucket in _buckets(weights):
        message, _ = encoder.encode(bucket, head)
        decoder.apply(message.clone(), head)
    encoder.finish(head)
    decoder.finish(head)
    return head


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert checksum(a[name]) == checksum(b[name]), name


def test_fifty_deltas_equal_a_full_sync_bit_for_bit() -> None:
    weights = _model()
    delta = WireEncoder(delta=True, full_every=1000, verify=True, wire_dtype=torch.bfloat16)
    full = WireEncoder(wire_dtype=torch.bfloat16)
    receiver, reference = WireDecoder(keep=True), WireDecoder(keep=True)
    kinds = []
    for version in range(51):
        if version:
            _step(weights, 1e-4, version)
        kinds.append(_sync(delta, receiver, weights, version).full)
        _sync(full, reference, weights, version)
    assert kinds == [True] + [False] * 50  # the first sync is full, then deltas only
    _assert_bitwise(receiver.mirror, reference.mirror)
    assert receiver.mirror["embed.weight"].dtype == torch.bfloat16
    assert receiver.mirror["steps"].dtype == torch.int64  # only floats change dtype
    assert receiver.mirror["odd"].dtype == torch.bfloat16


def test_a_small_update_sends_a_fraction_and_a_large_one_whole_tensors() -> None:
    weights = _model(vocab=1024)
    encoder = WireEncoder(delta=True, wire_dtype=torch.bfloat16)
    decoder = WireDecoder(keep=True)
    first = encoder.head(0)
    full_bytes = sum(encoder.encode(b, first)[1].bytes for b in _buckets(weights))
    encoder.finish(first)
    decoder.version = 0  # (the decoder is not needed to count the sender's bytes)
    weights["embed.weight"][0, :4] += 1.0  # four entries of one tensor
    head = encoder.head(1)
    stats = [encoder.encode(b, head)[1] for b in _buckets(weights)]
    encoder.finish(head)
    assert sum(s.changed for s in stats) == 4
    assert sum(s.bytes for s in stats) < full_bytes / 10
    _step(weights, 1.0, 2)  # every float entry changes: whole tensors, never bigger than full
    head = encoder.head(2)
    assert sum(encoder.encode(b, head)[1].bytes for b in _buckets(weights)) <= full_bytes


def test_a_full_sync_comes_every_full_every_versions() -> None:
    weights = _model()
    encoder = WireEncoder(delta=True, full_every=3)
    decoder = WireDecoder(keep=True)
    kinds = [_sync(encoder, decoder, weights, v).full for v in range(7)]
    assert kinds == [True, False, False, True, False, False, True]


def test_a_missed_or_reordered_delta_is_refused() -> None:
    weights = _model()
    encoder = WireEncoder(delta=True, full_every=100)
    decoder = WireDecoder(keep=True)
    _sync(encoder, decoder, weights, 0)
    _step(weights, 1e-2, 1)
    one = encoder.head(1)
    one_messages = [encoder.encode(b, one)[0] for b in _buckets(weights)]
    encoder.finish(one)  # delta 0 -> 1 sent, but never applied here (dropped)
    _step(weights, 1e-2, 2)
    two = encoder.head(2)
    assert two.base == 1
    assert not decoder.accepts(two)  # the receiver holds 0: delta 1 -> 2 does not apply
    assert decoder.accepts(one)
    for message in one_messages:  # in order it would apply; a rejoined receiver holds none
        decoder.apply(message, one)
    assert not WireDecoder(keep=True).accepts(two)
    assert not WireDecoder(keep=False).accepts(two)  # a direct-loading end never takes deltas


def test_a_corrupted_copy_fails_the_checksum() -> None:
    weights = _model()
    encoder = WireEncoder(delta=True, verify=True)
    decoder = WireDecoder(keep=True)
    _sync(encoder, decoder, weights, 0)
    decoder.mirror["layer.0.weight"][3, 3] += 1.0  # a bit flip in the receiver's copy
    weights["layer.0.weight"][0, 0] += 1.0  # a delta that leaves [3, 3] as it was
    head = encoder.head(1)
    messages = [encoder.encode(b, head)[0] for b in _buckets(weights)]
    with pytest.raises(ChecksumMismatch, match=r"layer\.0\.weight.*version 1"):
        for message in messages:
            decoder.apply(message, head)


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.2, 0.7])
def test_each_encoding_round_trips_and_the_smallest_is_chosen(fraction: float) -> None:
    """Few changes travel as positions, many as a bit mask, most as the whole tensor."""
    generator = torch.Generator().manual_seed(1)
    tensor = torch.randn(10_000, generator=generator).to(torch.bfloat16)
    encoder, decoder = WireEncoder(delta=True), WireDecoder(keep=True)
    head = encoder.head(0)
    decoder.apply(encoder.encode([("w", tensor)], head)[0], head)
    encoder.finish(head)
    decoder.finish(head)
    changed = torch.rand(10_000, generator=generator) < fraction
    tensor[changed] += 1.0
    head = encoder.head(1)
    message, stats = encoder.encode([("w", tensor)], head)
    entry = next(read_bucket(message))[0]
    expected = {0.001: "sparse", 0.01: "sparse", 0.2: "mask", 0.7: "dense"}[fraction]
    assert entry["encoding"] == expected
    assert stats.changed == int(changed.sum())
    decoder.apply(message, head)
    assert bits(decoder.mirror["w"]).equal(bits(tensor))


def test_payloads_stay_aligned_for_every_dtype() -> None:
    odd = [
        ("a", torch.arange(3, dtype=torch.uint8)),
        ("b", torch.randn(5).double()),
        ("c", torch.tensor([True, False, True])),
        ("d", torch.randn(3).half()),
        ("e", torch.arange(7, dtype=torch.int64)),
    ]
    encoder, decoder = WireEncoder(delta=True), WireDecoder(keep=True)
    head = encoder.head(0)
    decoder.apply(encoder.encode(odd, head)[0], head)
    encoder.finish(head)
    decoder.finish(head)
    odd[1][1][0] += 1.0
    odd[4][1][6] = 99
    head = encoder.head(1)
    changed, _ = decoder.apply(encoder.encode(odd, head)[0], head)
    assert [n for n, _ in changed] == ["b", "e"]
    for name, tensor in odd:
        assert decoder.mirror[name].equal(tensor), name


# ---------------------------------------------------------- over the channel, with a fault


class _Exporter:
    """A training engine as the sync sees it: export buckets of the given weights."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def export_weights(self, bucket_bytes: int) -> Iterator[list[NamedTensor]]:
        return iter(_buckets(self.weights))


class _Engine:
    """A rollout engine's weights (copied in, as real engines do)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.syncs = 0

    def load_weights(self, bucket: Any) -> None:
        for name, tensor in bucket:
            self.weights[name] = tensor.clone()

    def finish_weight_sync(self) -> None:
        self.syncs += 1

    def sync_metrics(self) -> dict[str, float]:
        return {}


def _pool_rank(address: Any, rank: int, versions: int, queue: Any) -> None:
    receiver = BroadcastReceiver(rank, torch.device("cpu"), staged=True)
    receiver.join(address)
    engine = _Engine()
    healed = []
    for version in range(versions):
        if rank == 1 and version == 5:
            receiver.decoder.version = 3  # a delta went missing here
        if rank == 0 and version == 8:
            receiver.decoder.mirror["steps"][0] += 1  # a corrupted copy (no delta rewrites it)
        healed.append(receiver.receive(engine)["sync/healed"])
    queue.put((rank, {n: checksum(t) for n, t in engine.weights.items()}, healed, receiver.version))


def test_over_the_channel_a_dropped_delta_and_a_corrupted_copy_are_healed() -> None:
    """Two pool ranks on one node (one relays to the other), 12 versions of deltas with
    checksums: pool rank 1 loses a delta before version 5, rank 0's copy is corrupted before 8;
    both are answered by a full sync in the same call, and every rank ends with the sender's
    weights bit for bit."""
    versions = 12
    weights = _model()
    sync = BroadcastSync(
        _Exporter(weights),  # type: ignore[arg-type]
        bucket_bytes=BUCKET,
        rank=0,
        device=torch.device("cpu"),
        encoder=WireEncoder(delta=True, full_every=100, verify=True, wire_dtype=torch.bfloat16),
    )
    address = sync.listen(("node", "node"))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = [ctx.Process(target=_pool_rank, args=(address, r, versions, queue)) for r in (0, 1)]
    for process in ranks:
        process.start()
    sync.join()
    rows = []
    for version in range(versions):
        if version:
            _step(weights, 1e-2, version)
        rows.append(sync.run(version))
    got = sorted(queue.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    sync.close()
    assert [r["sync/full"] for r in rows] == [1.0] + [0.0] * (versions - 1)
    assert [i for i, r in enumerate(rows) if r["sync/healed"]] == [5, 8]
    assert all(0 < r["sync/changed_fraction"] <= 1 for r in rows)
    expected = {n: checksum(sync.encoder.wire(t)) for n, t in weights.items()}
    for rank, sums, healed, version in got:
        assert sums == expected, rank
        assert version == versions - 1
        assert [i for i, h in enumerate(healed) if h] == [5, 8]
