"""Pure pieces, no engine: fused-layer grouping, seeds, sampling mapping, output packing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_core.engines import SamplingParams
from hf_vllm.outputs import pack_completions, strip_left_padding
from hf_vllm.sampling import request_seeds, truncates, vllm_sampling_kwargs
from hf_vllm.weights import (
    DEFAULT_PACKED_MODULES,
    CanonicalParams,
    FusedGroupBuffer,
    canonical_params,
    reload_group,
)

ATTN = "model.layers.3.self_attn"


def test_reload_group_follows_vllm_fusions() -> None:
    packed = DEFAULT_PACKED_MODULES
    for part in ("q_proj", "k_proj", "v_proj"):
        for kind in ("weight", "bias"):
            assert reload_group(f"{ATTN}.{part}.{kind}", packed) == f"{ATTN}.qkv_proj"
    assert reload_group(f"{ATTN}.o_proj.weight", packed) == f"{ATTN}.o_proj"
    assert (
        reload_group("model.layers.0.mlp.up_proj.weight", packed)
        == "model.layers.0.mlp.gate_up_proj"
    )
    assert (
        reload_group("model.layers.0.mlp.down_proj.weight", packed)
        == "model.layers.0.mlp.down_proj"
    )
    assert (
        reload_group("model.layers.1.mlp.experts.7.w2.weight", packed)
        == "model.layers.1.mlp.experts"
    )
    assert reload_group("model.norm.weight", packed) == "model.norm"


def _params() -> CanonicalParams:
    shapes = {f"{ATTN}.{p}.weight": (4, 4) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    shapes[f"{ATTN}.q_proj.bias"] = (4,)
    shapes["model.embed_tokens.weight"] = (10, 4)
    return CanonicalParams(shapes, {"lm_head.weight": "model.embed_tokens.weight"})


def test_buffer_releases_a_fused_layer_only_when_complete() -> None:
    buffer = FusedGroupBuffer(_params(), DEFAULT_PACKED_MODULES)
    t = torch.zeros(4, 4)
    assert buffer.add([(f"{ATTN}.q_proj.weight", t), (f"{ATTN}.o_proj.weight", t)]) == [
        (f"{ATTN}.o_proj.weight", t, False)  # whole, not a TP slice
    ]
    assert buffer.missing() == {
        f"{ATTN}.qkv_proj": [
            f"{ATTN}.k_proj.weight",
            f"{ATTN}.q_proj.bias",
            f"{ATTN}.v_proj.weight",
        ]
    }
    assert buffer.pending_bytes == 64
    ready = buffer.add(
        [(f"{ATTN}.k_proj.weight", t), (f"{ATTN}.v_proj.weight", t), (f"{ATTN}.q_proj.bias", t[0])]
    )
    assert [item.name for item in ready] == [
        f"{ATTN}.q_proj.weight",
        f"{ATTN}.k_proj.weight",
        f"{ATTN}.v_proj.weight",
        f"{ATTN}.q_proj.bias",
    ]
    assert buffer.missing() == {} and buffer.pending_bytes == 0


def test_buffer_checks_names_and_shapes_and_skips_tied_aliases() -> None:
    buffer = FusedGroupBuffer(_params(), DEFAULT_PACKED_MODULES)
    assert buffer.add([("lm_head.weight", torch.zeros(10, 4))]) == []
    assert buffer.missing() == {}
    with pytest.raises(KeyError, match=r"no parameter 'model\.bogus\.weight'"):
        buffer.add([("model.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"got shape \(3, 4\), rollout model has \(4, 4\)"):
        buffer.add([(f"{ATTN}.o_proj.weight", torch.zeros(3, 4))])
    buffer.add([("model.embed_tokens.weight", torch.zeros(10, 4))])
    assert buffer.stale_aliases() == ["lm_head.weight"]  # its packed copy needs refreshing
    buffer.clear()
    assert buffer.stale_aliases() == []


def test_canonical_params_are_what_a_training_engine_exports(models: dict) -> None:
    from transformers import AutoModelForCausalLM

    tied = canonical_params(models["qwen2_tied"])
    model = AutoModelForCausalLM.from_pretrained(models["qwen2_tied"])
    assert set(tied.shapes) == {n for n, _ in model.named_parameters()}
    assert tied.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied.shapes[f"{ATTN.replace('3', '0')}.q_proj.bias"] == (128,)
    untied = canonical_params(models["llama"])
    assert "lm_head.weight" in untied.shapes and not untied.aliases


def test_request_seeds_are_deterministic_distinct_and_bounded() -> None:
    seeds = request_seeds(7, 0, 100)
    assert seeds == request_seeds(7, 0, 100)
    assert len(set(seeds)) == 100
    assert set(seeds).isdisjoint(request_seeds(7, 1, 100))  # replicas sample differently
    assert set(seeds).isdisjoint(request_seeds(8, 0, 100))
    assert all(0 <= s < 2**62 for s in seeds)


def test_sampling_params_mapping() -> None:
    greedy = vllm_sampling_kwargs(
        SamplingParams(temperature=0, top_k=5, top_p=0.5, max_new_tokens=9, n=4),
        stop_token_ids=[2, 9, 2],
        ignore_eos=False,
    )
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0 and greedy["top_p"] == 1.0
    assert greedy["n"] == 1 and greedy["max_tokens"] == 9 and greedy["logprobs"] == 0
    assert greedy["stop_token_ids"] == [2, 9] and greedy["ignore_eos"] is True
    sampled = vllm_sampling_kwargs(
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9), stop_token_ids=[2], ignore_eos=True
    )
    assert sampled["temperature"] == 0.7 and sampled["top_k"] == 0 and sampled["top_p"] == 0.9
    assert sampled["stop_token_ids"] == []
    assert truncates(SamplingParams(top_p=0.9)) and truncates(SamplingParams(top_k=3))
    assert not truncates(SamplingParams()) and not truncates(SamplingParams(temperature=0, top_k=3))


def test_strip_left_padding_and_pack_completions() -> None:
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert strip_left_padding(ids, mask) == [[5, 6], [7, 8, 9, 10]]
    with pytest.raises(ValueError, match="no tokens"):
        strip_left_padding(ids, torch.zeros_like(mask))

    def completion(tokens: list[int], logps: list[float]) -> SimpleNamespace:
        steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logps, strict=True)]
        return SimpleNamespace(token_ids=tokens, logprobs=steps)

    responses, log_probs, response_mask = pack_completions(
        [completion([3, 2], [-0.5, -1.5]), completion([4, 4, 4], [-1.0, -2.0, -3.0])],
        max_new_tokens=3,
        pad_token_id=0,
        dtype=torch.long,
    )
    assert responses.tolist() == [[3, 2, 0], [4, 4, 4]]
    assert response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert log_probs.tolist() == [[-0.5, -1.5, 0.0], [-1.0, -2.0, -3.0]]
    assert log_probs.dtype == torch.float32


def test_cpu_shm_names_are_private_and_unlinked(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.device_communicators import cpu_communicator

    from hf_vllm.cpu_shm import SHM_DIR, private_shm_names, unlink_segments

    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what external_launcher's env:// gives
    shm_class = cpu_communicator._CPUSHMDistributed
    fake = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    shared = shm_class.make_group_name(fake)
    with private_shm_names("hfvllmtest") as applied:
        assert applied
        assert shm_class.make_group_name(fake) == "hfvllmtest" + shared.lstrip("/")
    assert shm_class.make_group_name(fake) == shared  # restored after the build

    ours, other = SHM_DIR / "hfvllmtest-x-cpushm_0", SHM_DIR / "hfvllmother-x-cpushm_0"
    ours.write_bytes(b"x")
    other.write_bytes(b"x")
    try:
        assert unlink_segments("hfvllmtest") == [ours.name]
        assert not ours.exists() and other.exists()
    finally:
        ours.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


def test_llm_kwargs(models: dict) -> None:
    from hf_vllm.config import VLLMRolloutConfig
    from hf_vllm.engine import llm_kwargs

    path = models["llama"]
    cfg = VLLMRolloutConfig(
        model_path=path, kv_cache_bytes=2**30, engine_kwargs={"max_num_seqs": 8, "block_size": 32}
    )
    cpu = llm_kwargs(cfg, path, "external_launcher", on_gpu=False)
    assert cpu["logprobs_mode"] == "processed_logprobs"  # log-probs after temperature
    assert cpu["distributed_executor_backend"] == "external_launcher"
    assert cpu["kv_cache_memory_bytes"] == 2**30 and "max_model_len" not in cpu
    assert cpu["max_num_seqs"] == 8 and cpu["block_size"] == 32  # engine_kwargs win
    assert cpu["skip_tokenizer_init"] is False  # the tiny folder has a tokenizer
    assert "enable_sleep_mode" not in cpu
    assert llm_kwargs(cfg, path, "uni", on_gpu=True)["enable_sleep_mode"] is True


def test_sequence_capacity_is_the_kv_cache_or_max_model_len(
    monkeypatch: pytest.MonkeyPatch, models: dict
) -> None:
    """The longest sequence the CPU engine can hold (the pre-start check compares responses
    with it): its fixed KV cache's share per token of this rank's heads, or max_model_len."""
    from hf_core.engines import DeclaresSequenceCapacity
    from hf_vllm.config import VLLMRolloutConfig

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    per_token = 512  # K and V values a token adds over every layer
    cfg = VLLMRolloutConfig(model_path=models["llama"], kv_cache_bytes=2**20)
    assert isinstance(cfg, DeclaresSequenceCapacity)
    assert cfg.sequence_capacity(per_token) == (
        512,
        "the 0.00 GiB KV cache (rollout.engine.kv_cache_bytes)",
    )
    tp2 = VLLMRolloutConfig(
        model_path=models["llama"], kv_cache_bytes=2**20, tensor_parallel_size=2
    )
    assert tp2.sequence_capacity(per_token)[0] == 1024  # each rank caches half the heads
    limited = VLLMRolloutConfig(model_path=models["llama"], kv_cache_bytes=2**30, max_model_len=300)
    assert limited.sequence_capacity(per_token) == (300, "rollout.engine.max_model_len")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    spaced = VLLMRolloutConfig(model_path=models["llama"]).sequence_capacity(per_token)
    assert spaced == (2**30 // 2048, "the 1.00 GiB KV cache (VLLM_CPU_KVCACHE_SPACE)")


class _Engine:
    def __init__(self, unfinished: bool | None) -> None:
        self.unfinished = unfinished

    def has_unfinished_requests(self) -> bool:
        if self.unfinished is None:
            raise RuntimeError("the engine core is gone")
        return self.unfinished


def test_a_failed_step_with_requests_scheduled_is_a_dead_engine() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    from hf_core.errors import EngineDiedError
    from hf_vllm.engine_health import engine_died, raise_if_engine_died

    refused, stepped, silent = (SimpleNamespace(llm_engine=_Engine(u)) for u in (False, True, None))
    step_error = RuntimeError("kernel failed")
    # vLLM refused the input and aborted what it had added: the same input fails again anywhere
    assert not engine_died(refused, ValueError("prompt too long"))
    raise_if_engine_died(refused, ValueError("prompt too long"))  # returns: re-raised as is
    assert engine_died(stepped, step_error)  # requests left scheduled: its state is lost
    assert engine_died(silent, step_error)  # cannot even report its requests
    assert engine_died(refused, EngineDeadError())  # vLLM's own verdict
    with pytest.raises(EngineDiedError, match="RuntimeError: kernel failed") as info:
        raise_if_engine_died(stepped, step_error)
    assert info.value.__cause__ is step_error
