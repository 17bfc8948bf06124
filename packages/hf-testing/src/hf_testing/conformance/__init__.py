"""The backend conformance kit: the checks every engine must pass, as pytest classes.

A backend's ``tests/test_conformance.py`` subclasses one class per engine it registers and
sets a few attributes; pytest collects the inherited checks::

    from hf_core.engines import ExportsHF
    from hf_testing.conformance import RolloutEngineConformance, TrainingEngineConformance

    class TestMyTrainingConformance(TrainingEngineConformance):
        engine = "my-engine"
        engine_config: ClassVar[dict[str, Any]] = {"lr": 1e-3}
        capabilities = frozenset({ExportsHF})

    class TestMyRolloutConformance(RolloutEngineConformance):
        engine = "my-rollout"

References are plain transformers and the model folder itself, never another backend.
"""

from hf_testing.conformance.reference import (
    canonical_buckets,
    folder_tensors,
    hf_causal_lm,
    hf_greedy,
    hf_log_probs_and_entropy,
    perturbed,
)
from hf_testing.conformance.rollout import RolloutEngineConformance
from hf_testing.conformance.training import TrainingEngineConformance

__all__ = [
    "RolloutEngineConformance",
    "TrainingEngineConformance",
    "canonical_buckets",
    "folder_tensors",
    "hf_causal_lm",
    "hf_greedy",
    "hf_log_probs_and_entropy",
    "perturbed",
]
