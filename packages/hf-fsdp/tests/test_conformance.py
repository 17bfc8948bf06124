"""The backend conformance kit: the "fsdp" training engine and the "transformers" rollout engine."""

from __future__ import annotations

from typing import Any, ClassVar

from hf_core.engines import ExportsHF, HasWorkerMesh, Offloadable, TrainsAdapters
from hf_testing.conformance import RolloutEngineConformance, TrainingEngineConformance


class TestFSDPConformance(TrainingEngineConformance):
    engine = "fsdp"
    engine_config: ClassVar[dict[str, Any]] = {"lr": 1e-3}
    # HasWorkerMesh: sequence-parallel ranks share a data chunk (parallel.sp)
    capabilities = frozenset({ExportsHF, HasWorkerMesh, Offloadable, TrainsAdapters})
    mixture_of_experts = "runs"


class TestTransformersRolloutConformance(RolloutEngineConformance):
    engine = "transformers"
    # the kit's references are float32 transformers forwards; the engine's default dtype,
    # auto, is bfloat16 on CPUs that compute it (tests/test_fsdp_config.py checks that)
    engine_config: ClassVar[dict[str, Any]] = {"dtype": "float32"}
    mixture_of_experts = "runs"
