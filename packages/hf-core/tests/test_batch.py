"""The Batch type: shapes checked, keys never silently overwritten, cheap to pickle."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from hf_core.batch import Batch, BatchError


def make(n: int = 6) -> Batch:
    return Batch(
        {"ids": torch.arange(n * 2).view(n, 2), "score": torch.arange(n, dtype=torch.float32)},
        {"text": [f"s{i}" for i in range(n)]},
        {"temperature": 0.7},
    )


def test_construction_checks_batch_size() -> None:
    with pytest.raises(BatchError, match="tensor 'b' has batch size 3, expected 2"):
        Batch({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(BatchError, match="non-tensor 't' has batch size 1, expected 2"):
        Batch({"a": torch.zeros(2)}, {"t": ["x"]})
    with pytest.raises(BatchError, match="scalar"):
        Batch({"a": torch.tensor(1.0)})


def test_access_and_assignment() -> None:
    batch = make()
    assert len(batch) == 6
    assert list(batch["text"]) == [f"s{i}" for i in range(6)]
    batch["new"] = torch.ones(6)
    batch["label"] = ["x"] * 6
    assert set(batch.keys()) == {"ids", "score", "text", "new", "label"}
    with pytest.raises(BatchError, match="expected leading dimension 6"):
        batch["bad"] = torch.ones(5)
    with pytest.raises(KeyError, match="batch has no key 'missing'"):
        batch["missing"]
    assert batch.pop("new").shape == (6,)
    assert "new" not in batch


def test_chunk_concat_round_trip() -> None:
    batch = make()
    chunks = batch.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert list(chunks[1]["text"]) == ["s2", "s3"]
    assert chunks[2]["ids"].tolist() == [[8, 9], [10, 11]]
    joined = Batch.concat(chunks)
    assert torch.equal(joined["ids"], batch["ids"])
    assert list(joined["text"]) == list(batch["text"])
    assert joined.meta == {"temperature": 0.7}
    with pytest.raises(BatchError, match="does not split into 4 equal chunks"):
        batch.chunk(4)


def test_split_keeps_remainder() -> None:
    assert [len(b) for b in make(7).split(3)] == [3, 3, 1]


def test_concat_rejects_mismatched_keys_and_meta() -> None:
    a, b = make(2), make(2)
    b.meta["temperature"] = 1.0
    with pytest.raises(BatchError, match="meta 'temperature' differs"):
        Batch.concat([a, b])
    with pytest.raises(BatchError, match="batch 1 has keys"):
        Batch.concat([a, make(2).select("ids")])


def test_select_and_index() -> None:
    batch = make()
    picked = batch.select("ids", "text")
    assert set(picked.keys()) == {"ids", "text"}
    sub = batch.index([5, 0])
    assert sub["score"].tolist() == [5.0, 0.0] and list(sub["text"]) == ["s5", "s0"]
    masked = batch.index(torch.tensor([True, False] * 3))
    assert masked["score"].tolist() == [0.0, 2.0, 4.0]


def test_union_merges_and_checks_clashes() -> None:
    batch = make()
    merged = batch | Batch({"values": torch.ones(6)}, meta={"step": 3})
    assert set(merged.keys()) == {"ids", "score", "text", "values"}
    assert merged.meta == {"temperature": 0.7, "step": 3}
    assert "values" not in batch  # the original is untouched
    same = batch | batch.select("ids")  # equal values are fine
    assert torch.equal(same["ids"], batch["ids"])
    with pytest.raises(BatchError, match="key 'score' differs"):
        batch | Batch({"score": torch.zeros(6)})
    with pytest.raises(BatchError, match="cannot union batches of size 6 and 2"):
        batch | make(2)
    with pytest.raises(BatchError, match="meta 'temperature' differs"):
        batch | Batch({"x": torch.zeros(6)}, meta={"temperature": 1.0})


def test_repeat_interleave_makes_consecutive_groups() -> None:
    grouped = make(2).repeat_interleave(3)
    assert grouped["score"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert list(grouped["text"]) == ["s0"] * 3 + ["s1"] * 3


def test_pad_and_unpad() -> None:
    batch = make(5)
    padded, pad = batch.pad_to_multiple(4)
    assert (len(padded), pad) == (8, 3)
    assert padded["score"].tolist()[5:] == [0.0, 1.0, 2.0]  # real samples reused
    restored = padded.unpad(pad)
    assert torch.equal(restored["ids"], batch["ids"])
    assert batch.pad_to_multiple(5) == (batch, 0)
    with pytest.raises(BatchError):
        batch.unpad(6)


def test_pickle_round_trip() -> None:
    batch = make()
    clone = pickle.loads(pickle.dumps(batch))
    assert torch.equal(clone["ids"], batch["ids"])
    assert list(clone["text"]) == list(batch["text"]) and clone.meta == batch.meta
    assert isinstance(clone["text"], np.ndarray)


def test_non_tensor_only_batch() -> None:
    batch = Batch(non_tensors={"prompt": ["a", "b", "c", "d"]})
    assert len(batch) == 4
    assert [list(c["prompt"]) for c in batch.chunk(2)] == [["a", "b"], ["c", "d"]]
    assert len(Batch.concat(batch.chunk(2))) == 4
