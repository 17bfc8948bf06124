"""GPU-only checks (skipped without CUDA): nccl, bf16 mixed precision, offload/onload.

The FSDP job runs under torchrun in fresh processes (nccl needs its own process group; the
CPU tests in this session may already have made a gloo one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_testing.gpu import assert_bf16_log_probs, assert_offload_round_trip, torchrun_job_fixture

pytestmark = pytest.mark.gpu


gpu_job = torchrun_job_fixture(Path(__file__).parent / "fsdp_gpu_job.py")


def test_nccl_and_bf16_compute_over_fp32_master_weights(gpu_job: list[dict], models: dict) -> None:
    for result in gpu_job:
        assert result["backend"] == "nccl"
        assert result["device"].startswith("cuda")
        assert result["master_dtype"] == "torch.float32"
        assert_bf16_log_probs(result, models["llama"])


def test_offload_frees_gpu_memory_and_onload_restores(gpu_job: list[dict]) -> None:
    for result in gpu_job:
        assert_offload_round_trip(result)
        assert result["shard_devices_offloaded"] == ["cpu"]


def test_fsdp_cpu_offload_policy_keeps_shards_on_host(gpu_job: list[dict]) -> None:
    for result in gpu_job:
        assert result["host_shard_devices"] == ["cpu"]
        assert torch.isfinite(result["host_log_probs"]).all()
        assert result["host_exported"] > 10


def test_hf_rollout_on_gpu_matches_generate_and_releases_memory(models: dict) -> None:
    from hf_fsdp.rollout import TransformersRolloutEngine

    path = models["qwen2_tied"]
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    enc = tokenizer(["reverse 12:", "3+4=", "hi"], return_tensors="pt", padding=True)
    # the default (dtype auto) is bfloat16 on a GPU with bf16; greedy parity with float32
    # `generate` is float32's check, so this engine pins it
    default = TransformersRolloutEngine({"model_path": str(path), "device": "cuda"})
    assert default.compute_dtype == torch.bfloat16
    assert next(default.model.parameters()).dtype == torch.bfloat16
    del default
    engine = TransformersRolloutEngine(
        {"model_path": str(path), "device": "cuda", "dtype": "float32"}
    )
    out = engine.generate(
        Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}),
        SamplingParams(temperature=0, max_new_tokens=8),
    )
    model = AutoModelForCausalLM.from_pretrained(path).cuda()
    expected = model.generate(
        **enc.to("cuda"), do_sample=False, max_new_tokens=8, pad_token_id=0
    ).cpu()[:, enc["input_ids"].shape[1] :]
    mask = out["response_mask"][:, : expected.shape[1]].bool()
    assert torch.equal(out["responses"][:, : expected.shape[1]][mask], expected[mask])
    engine.release_memory()
    assert next(engine.model.parameters()).device.type == "cpu"
    engine.resume_memory()
    assert next(engine.model.parameters()).device.type == "cuda"
