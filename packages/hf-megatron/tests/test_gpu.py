"""GPU-only checks (skipped without CUDA): nccl, Transformer Engine spec, bf16, offload.

The job runs under torchrun in fresh processes (nccl needs its own process group).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_job(models: dict, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("gpu_job")
    world = min(2, torch.cuda.device_count())
    script = Path(__file__).parent / "megatron_gpu_job.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"]
    cmd += [str(script), str(models["llama"]), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_nccl_te_spec_and_bf16_log_probs(gpu_job: list[dict], models: dict) -> None:
    model = AutoModelForCausalLM.from_pretrained(models["llama"])
    for result in gpu_job:
        assert result["backend"] == "nccl" and result["device"].startswith("cuda")
        assert result["spec"] == ("transformer_engine" if result["have_te"] else "local")
        assert result["param_dtype"] == "torch.bfloat16"
        batch = result["batch"]
        with torch.no_grad():
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).logits[:, -batch["responses"].shape[1] - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
        diff = ((result["log_probs"] - expected) * batch["response_mask"]).abs()
        assert float(diff.mean()) < 0.05  # close to fp32 ...
        assert float(diff.max()) > 1e-6  # ... but computed in bf16
        assert torch.isfinite(torch.tensor(result["metrics"]["grad_norm"]))
        assert result["exported"] > 10 and result["received_fraction"] >= 0


def test_offload_frees_gpu_memory_and_onload_restores(gpu_job: list[dict]) -> None:
    for result in gpu_job:
        assert result["mem_offloaded"] < 0.5 * result["mem_trained"]
        assert "offloaded; call onload() first" in result["offloaded_error"]
        assert result["mem_onloaded"] >= 0.9 * result["mem_trained"]
        assert result["metrics_after_onload"]["update_skipped"] == 0.0
