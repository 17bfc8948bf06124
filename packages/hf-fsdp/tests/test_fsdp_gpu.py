"""GPU-only checks (skipped without CUDA): nccl, bf16 mixed precision, offload/onload.

The FSDP job runs under torchrun in fresh processes (nccl needs its own process group; the
CPU tests in this session may already have made a gloo one).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_core.batch import Batch
from hf_core.engines import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_job(models: dict, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("gpu_job")
    world = min(2, torch.cuda.device_count())
    script = Path(__file__).parent / "fsdp_gpu_job.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"]
    cmd += [str(script), str(models["llama"]), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_nccl_and_bf16_compute_over_fp32_master_weights(gpu_job: list[dict], models: dict) -> None:
    model = AutoModelForCausalLM.from_pretrained(models["llama"])
    for result in gpu_job:
        assert result["backend"] == "nccl"
        assert result["device"].startswith("cuda")
        assert result["master_dtype"] == "torch.float32"
        batch: Batch = result["batch"]
        with torch.no_grad():
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).logits[:, -batch["responses"].shape[1] - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
        diff = ((result["log_probs"].cpu() - expected) * batch["response_mask"]).abs()
        assert float(diff.mean()) < 0.05  # close to fp32 ...
        assert float(diff.max()) > 1e-6  # ... but computed in bf16, not fp32
        assert torch.isfinite(torch.tensor(result["metrics"]["grad_norm"]))


def test_offload_frees_gpu_memory_and_onload_restores(gpu_job: list[dict]) -> None:
    for result in gpu_job:
        assert result["mem_offloaded"] < 0.5 * result["mem_trained"]
        assert result["shard_devices_offloaded"] == ["cpu"]
        assert "offloaded; call onload() first" in result["offloaded_forward_error"]
        assert result["mem_onloaded"] >= 0.9 * result["mem_trained"]
        assert result["metrics_after_onload"]["update_skipped"] == 0.0


def test_fsdp_cpu_offload_policy_keeps_shards_on_host(gpu_job: list[dict]) -> None:
    for result in gpu_job:
        assert result["host_shard_devices"] == ["cpu"]
        assert torch.isfinite(result["host_log_probs"]).all()
        assert result["host_exported"] > 10


def test_hf_rollout_on_gpu_matches_generate_and_releases_memory(models: dict) -> None:
    from hf_fsdp.rollout import HFRolloutEngine

    path = models["qwen2_tied"]
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    enc = tokenizer(["reverse 12:", "3+4=", "hi"], return_tensors="pt", padding=True)
    engine = HFRolloutEngine({"model_path": str(path), "device": "cuda"})
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
