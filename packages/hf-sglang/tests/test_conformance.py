"""The backend conformance kit for the "sglang" rollout engine (one engine, in this process)."""

from __future__ import annotations

from typing import Any, ClassVar

from conftest import needs_sglang

from hf_testing.conformance import RolloutEngineConformance


@needs_sglang
class TestSGLangConformance(RolloutEngineConformance):
    engine = "sglang"
    engine_config: ClassVar[dict[str, Any]] = {"device": "cpu", "max_total_tokens": 8192}
    # Same weights, same tokens; SGLang batches requests as they arrive, so the float32
    # summation order (and the last bits of a log-prob) may differ between two generations.
    restore_log_prob_atol = 1e-5
    # the tiny Qwen3-MoE runs on SGLang's CPU path, and in-place syncs of its per-expert
    # tensors keep greedy decoding equal to transformers'; routing is not returned (settings)
    mixture_of_experts = "runs"
