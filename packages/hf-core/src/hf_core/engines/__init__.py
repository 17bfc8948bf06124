"""Engine interfaces: what a backend implements so core's role workers can drive it."""

from hf_core.engines.rollout import RolloutEngine, SamplingParams
from hf_core.engines.training import LossFn, TrainingEngine
from hf_core.engines.weights import NamedTensor, WeightMapping, iter_buckets, tensor_nbytes

__all__ = [
    "LossFn",
    "NamedTensor",
    "RolloutEngine",
    "SamplingParams",
    "TrainingEngine",
    "WeightMapping",
    "iter_buckets",
    "tensor_nbytes",
]
