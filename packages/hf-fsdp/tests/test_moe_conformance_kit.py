"""The conformance kit's mixture-of-experts declaration: an engine declaring
``mixture_of_experts = "runs"`` gets the MoE checks; any other must refuse an MoE model by
name, and one that builds it without declaring fails asking for the declaration (no backend
skips the MoE checks silently)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from hf_testing.conformance import RolloutEngineConformance, TrainingEngineConformance
from hf_testing.conformance.rollout import MOE_CHECKS as ROLLOUT_MOE_CHECKS
from hf_testing.conformance.training import MOE_CHECKS as TRAINING_MOE_CHECKS

REFUSAL = "test_a_mixture_of_experts_model_is_refused_by_name"


class _Runs(TrainingEngineConformance):
    engine = "fsdp"
    mixture_of_experts = "runs"


class _Undeclared(RolloutEngineConformance):
    engine = "transformers"
    engine_config: ClassVar[dict[str, Any]] = {"dtype": "float32"}


class _Refused(RolloutEngineConformance):
    engine = "transformers"
    mixture_of_experts = "refused"


def test_the_declaration_chooses_the_checks() -> None:
    assert all(callable(getattr(_Runs, name)) for name in TRAINING_MOE_CHECKS)
    assert getattr(_Runs, REFUSAL) is None
    for cls in (_Undeclared, _Refused):
        assert all(getattr(cls, name) is None for name in ROLLOUT_MOE_CHECKS)
        assert callable(getattr(cls, REFUSAL))


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def test_an_engine_that_builds_an_moe_model_must_declare_it(moe_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="declare mixture_of_experts = 'runs'"):
        getattr(_Undeclared(), REFUSAL)(moe_path)
    with pytest.raises(pytest.fail.Exception, match="declares mixture_of_experts = 'refused'"):
        getattr(_Refused(), REFUSAL)(moe_path)
