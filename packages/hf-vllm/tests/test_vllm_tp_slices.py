"""Generation-TP slices without an engine: vLLM's partition of canonical tensors, the checks
a slice passes on arrival, and the bytes of a rank's shard."""

from __future__ import annotations

import pytest
import torch

from hf_core.engines import CanonicalSlice
from hf_vllm.tp_slices import VLLMPartition, vllm_param_name
from hf_vllm.weights import DEFAULT_PACKED_MODULES, CanonicalParams, FusedGroupBuffer

ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
# 8 query heads, 4 KV heads of 16: q 128 rows, k/v 64 rows; hidden 128; ffn 256; vocab 100
SHAPES = {
    "model.embed_tokens.weight": (100, 128),
    f"{ATTN}.q_proj.weight": (128, 128),
    f"{ATTN}.k_proj.weight": (64, 128),
    f"{ATTN}.v_proj.weight": (64, 128),
    f"{ATTN}.q_proj.bias": (128,),
    f"{ATTN}.k_proj.bias": (64,),
    f"{ATTN}.v_proj.bias": (64,),
    f"{ATTN}.o_proj.weight": (128, 128),
    f"{MLP}.gate_proj.weight": (256, 128),
    f"{MLP}.up_proj.weight": (256, 128),
    f"{MLP}.down_proj.weight": (128, 256),
    "model.layers.0.input_layernorm.weight": (128,),
    "model.norm.weight": (128,),
    "lm_head.weight": (100, 128),
}


def partition(tp: int = 2) -> VLLMPartition:
    return VLLMPartition(tp_size=tp, vocab_size=100, num_kv_heads=4)


def test_partition_splits_like_vllm_tensor_parallel_layers() -> None:
    part = partition()
    r = part.tp_range
    assert r(f"{ATTN}.q_proj.weight", (128, 128), 1) == (0, 64, 128)
    assert r(f"{ATTN}.k_proj.weight", (64, 128), 1) == (0, 32, 64)
    assert r(f"{ATTN}.v_proj.bias", (64,), 0) == (0, 0, 32)
    assert r(f"{MLP}.up_proj.weight", (256, 128), 1) == (0, 128, 256)
    assert r(f"{ATTN}.o_proj.weight", (128, 128), 1) == (1, 64, 128)
    assert r(f"{MLP}.down_proj.weight", (128, 256), 0) == (1, 0, 128)
    assert r(f"{ATTN}.o_proj.bias", (128,), 1) is None  # row-parallel biases are replicated
    assert r("model.norm.weight", (128,), 1) is None
    # vocabulary: 100 padded to 128 (a multiple of 64), 64 rows per rank, clipped to 100
    assert r("model.embed_tokens.weight", (100, 128), 0) == (0, 0, 64)
    assert r("lm_head.weight", (100, 128), 1) == (0, 64, 100)
    assert partition(1).tp_range(f"{ATTN}.q_proj.weight", (128, 128), 0) is None


def test_kv_heads_fewer_than_ranks_are_replicated_per_head() -> None:
    part = VLLMPartition(tp_size=8, vocab_size=100, num_kv_heads=4)
    assert [part.tp_range(f"{ATTN}.k_proj.weight", (64, 128), r) for r in range(8)] == [
        (0, 16 * (r // 2), 16 * (r // 2 + 1)) for r in range(8)
    ]


def test_vocab_ranges_are_vllms_own() -> None:
    """The pure vocabulary split against vLLM's VocabParallelEmbedding index arithmetic."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
        pad_vocab_size,
    )

    for vocab, tp in [(100, 2), (128, 2), (151_936, 4), (32_000, 8), (65, 2)]:
        part = VLLMPartition(tp_size=tp, vocab_size=vocab, num_kv_heads=1)
        padded = pad_vocab_size(vocab)
        assert part.padded_vocab == padded
        for rank in range(tp):
            idx = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp)
            want = (0, idx.org_vocab_start_index, idx.org_vocab_end_index)
            assert part.tp_range("model.embed_tokens.weight", (vocab, 8), rank) == want


def _slice(name: str, rank: int, part: VLLMPartition) -> CanonicalSlice:
    full = torch.arange(torch.Size(SHAPES[name]).numel(), dtype=torch.float32).view(SHAPES[name])
    block = part.tp_range(name, SHAPES[name], rank)
    if block is None:
        return CanonicalSlice(name, full, None, 0, SHAPES[name])
    dim, start, stop = block
    return CanonicalSlice(name, full.narrow(dim, start, stop - start), dim, start, SHAPES[name])


def buffer(rank: int = 1) -> FusedGroupBuffer:
    params = CanonicalParams(dict(SHAPES))
    return FusedGroupBuffer(params, DEFAULT_PACKED_MODULES, partition(), rank)


def test_buffer_takes_this_ranks_blocks_and_marks_them_sharded() -> None:
    buf = buffer()
    weights = [_slice(f"{ATTN}.{p}_proj.weight", 1, partition()) for p in "qkv"]
    biases = [_slice(f"{ATTN}.{p}_proj.bias", 1, partition()) for p in "qkv"]
    assert buf.add(weights) == []  # the fused layer waits for its biases
    ready = buf.add([*biases, _slice("model.norm.weight", 1, partition())])
    assert [r.sharded for r in ready] == [True] * 6 + [False]  # a replicated tensor: whole
    assert [tuple(r.tensor.shape) for r in ready[:3]] == [(64, 128), (32, 128), (32, 128)]


def test_buffer_narrows_whole_parts_of_a_parameter_that_gets_blocks() -> None:
    buf = buffer()
    q = torch.randn(128, 128)
    ready = buf.add(
        [
            (f"{MLP}.gate_proj.weight", torch.randn(256, 128)),
            _slice(f"{MLP}.up_proj.weight", 1, partition()),
        ]
    )
    assert [(r.sharded, tuple(r.tensor.shape)) for r in ready] == [(True, (128, 128))] * 2
    # a whole parameter on its own stays whole (the FSDP path is unchanged)
    ready = buf.add([(f"{ATTN}.o_proj.weight", q)])
    assert ready[0].sharded is False and ready[0].tensor is q


def test_mismatched_vocab_block_names_both_ranges_and_the_fix() -> None:
    buf = buffer(rank=1)
    # megatron's default padding: 100 -> 256 (128 x tp 2): rank 1 gets [128, 100) = nothing
    bad = CanonicalSlice("lm_head.weight", torch.zeros(0, 128), 0, 100, (100, 128))
    with pytest.raises(ValueError) as err:
        buf.add([_slice(f"{ATTN}.o_proj.weight", 1, partition()), bad])
    text = str(err.value)
    assert "lm_head.weight" in text and "dim 0 [100, 100)" in text and "dim 0 [64, 100)" in text
    assert "make_vocab_size_divisible_by" in text
    assert buf.pending == {} and buf.released == set()  # a bad bucket changes nothing


def test_slices_of_replicated_tensors_wrong_shapes_and_whole_slices() -> None:
    buf = buffer()
    half = CanonicalSlice("model.norm.weight", torch.zeros(64), 0, 64, (128,))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: TP slice dim 0 \[64, 128\).*"):
        buf.add([half])
    wrong = CanonicalSlice(f"{ATTN}.o_proj.weight", torch.zeros(64, 64), 1, 64, (128, 128))
    with pytest.raises(ValueError, match=r"this rank's block dim 1 \[64, 128\) has shape"):
        buf.add([wrong])
    other = CanonicalSlice(f"{ATTN}.o_proj.weight", torch.zeros(64, 128), 1, 64, (128, 256))
    with pytest.raises(ValueError, match=r"slice of a tensor of shape \(128, 256\)"):
        buf.add([other])
    full = CanonicalSlice(f"{ATTN}.o_proj.weight", torch.zeros(128, 128), None, 0, (128, 128))
    assert buf.add([full])[0].sharded is False
    whole_only = FusedGroupBuffer(CanonicalParams(dict(SHAPES)), DEFAULT_PACKED_MODULES)
    with pytest.raises(ValueError, match="whole tensors only"):
        whole_only.add([_slice(f"{ATTN}.o_proj.weight", 0, partition())])


def test_shard_bytes_and_vllm_param_names() -> None:
    part = partition()
    total = sum(torch.Size(s).numel() for s in SHAPES.values()) * 4
    shards = [part.shard_bytes(SHAPES, r, 4) for r in range(2)]
    vocab_padding = 2 * (128 - 100) * 128 * 4  # embedding + lm_head rows vLLM pads
    replicated = (128 + 128) * 4  # two norms on both ranks
    assert sum(shards) == total + vocab_padding + replicated
    assert partition(1).shard_bytes(SHAPES, 0, 4) == total
    assert vllm_param_name(f"{ATTN}.qkv_proj", f"{ATTN}.k_proj.bias") == f"{ATTN}.qkv_proj.bias"
