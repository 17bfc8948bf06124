"""GPU-only checks (skipped without CUDA): nccl, Transformer Engine spec, bf16, offload.

The job runs under torchrun in fresh processes (nccl needs its own process group).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_testing.gpu import assert_bf16_log_probs, assert_offload_round_trip, torchrun_job_fixture

pytestmark = pytest.mark.gpu


gpu_job = torchrun_job_fixture(Path(__file__).parent / "megatron_gpu_job.py")


def test_nccl_te_spec_and_bf16_log_probs(gpu_job: list[dict], models: dict) -> None:
    for result in gpu_job:
        assert result["backend"] == "nccl" and result["device"].startswith("cuda")
        assert result["spec"] == ("transformer_engine" if result["have_te"] else "local")
        assert result["param_dtype"] == "torch.bfloat16"
        assert_bf16_log_probs(result, models["llama"])
        assert result["exported"] > 10 and result["received_fraction"] >= 0


def test_offload_frees_gpu_memory_and_onload_restores(gpu_job: list[dict]) -> None:
    for result in gpu_job:
        assert_offload_round_trip(result)
