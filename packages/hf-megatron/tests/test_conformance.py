"""The backend conformance kit for the "megatron" training engine (one rank, in-process).

One layout (tp = pp = 1) for the whole class: megatron keeps its process groups in globals,
one layout per process, and nothing else in this test process builds a megatron engine.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hf_core.engines import ExportsHF, HasWorkerMesh, Offloadable
from hf_testing.conformance import TrainingEngineConformance


class TestMegatronConformance(TrainingEngineConformance):
    engine = "megatron"
    engine_config: ClassVar[dict[str, Any]] = {"lr": 1e-3}
    capabilities = frozenset({ExportsHF, HasWorkerMesh, Offloadable})
    mixture_of_experts = "runs"  # Qwen3-MoE (issue 59; tests/test_moe.py for ep and replay)
