"""HF <-> megatron weight mapping, without megatron or a process group (pure tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig, Qwen2Config

from hf_megatron.reshard import SliceAssembler, generation_targets
from hf_megatron.weight_mapping import (
    MappingError,
    MegatronWeightMapping,
    ModelDims,
    RankPosition,
    fetch_from,
    rank_params,
    tp_slice_range,
)

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _state(path: Path) -> tuple[ModelDims, dict[str, torch.Tensor]]:
    config = AutoConfig.from_pretrained(path)
    state = load_file(path / "model.safetensors")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return ModelDims.from_hf(config, "lm"), state


def _assemble(pieces: list) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for piece in pieces:
        full = out.setdefault(piece.name, torch.full(piece.full_shape, float("nan")))
        if piece.dim is None:
            full.copy_(piece.tensor)
        else:
            full.narrow(piece.dim, piece.start, piece.tensor.shape[piece.dim]).copy_(piece.tensor)
    return out


@pytest.mark.parametrize("folder", ["qwen2_tied", "qwen2", "llama", "llama_tied", "odd_vocab"])
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
@pytest.mark.parametrize("divisible_by", [1, 128])
def test_round_trip_is_exact_per_tp_rank_and_stage(
    models: dict, folder: str, tp: int, pp: int, divisible_by: int
) -> None:
    dims, state = _state(models[folder])
    padded = dims.padded_vocab(tp, divisible_by)
    pieces = []
    for stage in range(pp):
        for rank in range(tp):
            mapping = MegatronWeightMapping(dims, RankPosition(rank, tp, stage, pp), padded)
            native = dict(mapping.load(fetch_from(state)))
            assert {n: tuple(t.shape) for n, t in native.items()} == mapping.native_shapes()
            streamed = dict(mapping.from_canonical(reversed(list(state.items()))))
            assert streamed.keys() == native.keys()
            assert all(torch.equal(streamed[n], native[n]) for n in native)
            pieces += list(mapping.canonical_pieces(native))
    back = _assemble(pieces)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_is_interleaved_per_kv_group_and_fc1_is_gate_then_up() -> None:
    """Spell the fused layouts out with recognisable values (2 KV groups, 2 q heads each)."""
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=6,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=2,
    )
    dims = ModelDims.from_hf(config, "lm")
    state = {n: torch.zeros(s) for n, s in dims.canonical_shapes().items()}
    p = "model.layers.0."
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        rows = state[f"{p}self_attn.{name}.weight"].shape[0]
        head = torch.arange(rows) // 2  # head index of each row (head_dim 2)
        state[f"{p}self_attn.{name}.weight"] = (100 * (i + 1) + head)[:, None].expand(-1, 8) * 1.0
        state[f"{p}self_attn.{name}.bias"] = (100 * (i + 1) + head) * 1.0
    state[f"{p}mlp.gate_proj.weight"] = torch.arange(6)[:, None].expand(-1, 8) * 1.0
    state[f"{p}mlp.up_proj.weight"] = 10 + torch.arange(6)[:, None].expand(-1, 8) * 1.0
    for rank in range(2):
        native = dict(
            MegatronWeightMapping(dims, RankPosition(rank, 2), 16).load(fetch_from(state))
        )
        qkv = native["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].reshape(-1, 2)
        group = rank  # one KV group per TP rank
        heads = [int(v) for v in qkv[:, 0]]
        assert heads == [100 + 2 * group, 101 + 2 * group, 200 + group, 300 + group]
        bias = native["decoder.layers.0.self_attention.linear_qkv.bias"].reshape(-1, 2)[:, 0]
        assert bias.tolist() == heads
        fc1 = native["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist()
        assert fc1 == [
            3 * rank,
            3 * rank + 1,
            3 * rank + 2,
            10 + 3 * rank,
            11 + 3 * rank,
            12 + 3 * rank,
        ]


def test_vocab_padding_rows_are_zero_and_not_exported(models: dict) -> None:
    dims, state = _state(models["odd_vocab"])  # 131 tokens
    padded = dims.padded_vocab(2, 4)
    assert padded == 136
    last = MegatronWeightMapping(dims, RankPosition(1, 2, 0, 1), padded)
    native = dict(last.load(fetch_from(state)))
    emb = native["embedding.word_embeddings.weight"]
    assert emb.shape == (68, dims.hidden_size)
    assert torch.equal(emb[:63], state["model.embed_tokens.weight"][68:])
    assert not emb[63:].any()
    piece = next(p for p in last.canonical_pieces(native) if p.name == "model.embed_tokens.weight")
    assert (piece.dim, piece.start, piece.stop) == (0, 68, 131)


def test_tied_copy_on_last_stage_loads_but_is_not_exported(models: dict) -> None:
    dims, state = _state(models["qwen2_tied"])
    mapping = MegatronWeightMapping(dims, RankPosition(0, 1, 1, 2))
    native = dict(mapping.load(fetch_from(state)))
    assert torch.equal(
        native["output_layer.weight"][: dims.vocab_size], state["model.embed_tokens.weight"]
    )
    assert "model.embed_tokens.weight" not in {p.name for p in mapping.canonical_pieces(native)}


def test_generation_slices_assemble_from_training_pieces(models: dict) -> None:
    """TP=2 pieces of both ranks -> each generation TP rank's slice (t_g = 2) and whole
    tensors (t_g = 1), checked against the canonical tensors."""
    from hf_core.resharding import GenerationLayout, ParallelLayout, build_hybrid_plan

    dims, state = _state(models["odd_vocab"])
    padded = dims.padded_vocab(2, 1)
    pieces = [
        p
        for r in range(2)
        for p in MegatronWeightMapping(dims, RankPosition(r, 2), padded).canonical_pieces(
            dict(MegatronWeightMapping(dims, RankPosition(r, 2), padded).load(fetch_from(state)))
        )
    ]
    train = ParallelLayout(pp=1, tp=2, dp=1)
    for t_g in (1, 2):
        plan = build_hybrid_plan(train, GenerationLayout(pp=1, tp=t_g))
        for rank in range(2):
            rp = plan.for_rank(rank)
            assembler = SliceAssembler(
                generation_targets(dims, rp, plan.gen, padded), torch.float32
            )
            for piece in pieces:
                assembler.add(piece)
            assert assembler.missing() == []
            for s in assembler.pop_ready():
                full = state[s.name]
                want = full if s.dim is None else full.narrow(s.dim, s.start, s.stop - s.start)
                assert torch.equal(s.tensor, want), (t_g, rank, s.name)
                if t_g == 1:
                    assert s.is_full


def test_tp_slice_ranges_follow_megatron_and_vllm_partitions(models: dict) -> None:
    dims, _ = _state(models["llama"])
    p = "model.layers.0."
    assert tp_slice_range(dims, p + "self_attn.q_proj.weight", 1, 2, 256) == (0, 32, 64)
    assert tp_slice_range(dims, p + "self_attn.k_proj.weight", 1, 2, 256) == (0, 16, 32)
    assert tp_slice_range(dims, p + "self_attn.o_proj.weight", 0, 2, 256) == (1, 0, 32)
    assert tp_slice_range(dims, p + "mlp.down_proj.weight", 1, 2, 256) == (1, 64, 128)
    assert tp_slice_range(dims, p + "input_layernorm.weight", 1, 2, 256) == (None, 0, 0)
    assert tp_slice_range(dims, "lm_head.weight", 1, 2, 256) == (0, 128, 128)  # all padding


def test_unsupported_models_and_layouts_are_clear_errors() -> None:
    with pytest.raises(MappingError, match="attention_bias"):
        ModelDims.from_hf(LlamaConfig(attention_bias=True), "lm")
    dims = ModelDims.from_hf(
        LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), "lm"
    )
    with pytest.raises(MappingError, match="num_kv_heads=2"):
        rank_params(dims, RankPosition(0, 4), dims.padded_vocab(4, 1))
    with pytest.raises(MappingError, match="divisible by tp"):
        rank_params(dims, RankPosition(0, 2), dims.vocab_size + 1)
