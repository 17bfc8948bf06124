"""Engine interfaces: what a backend implements so core's role workers can drive it."""

from hf_core.engines.capabilities import (
    Closeable,
    ExportsHF,
    GenerationRank,
    HasGenerationRank,
    HasWorkerMesh,
    LoadsTPSlices,
    Offloadable,
)
from hf_core.engines.dtypes import DTypeName, HeadKind, to_dtype
from hf_core.engines.rollout import PROMPT_KEYS, RolloutEngine, SamplingParams, assemble_rollout
from hf_core.engines.sampling import filter_logits, select_tokens
from hf_core.engines.schedule import lr_factor
from hf_core.engines.training import LossFn, TrainingEngine
from hf_core.engines.weights import NamedTensor, WeightMapping, iter_buckets, tensor_nbytes

__all__ = [
    "PROMPT_KEYS",
    "Closeable",
    "DTypeName",
    "ExportsHF",
    "GenerationRank",
    "HasGenerationRank",
    "HasWorkerMesh",
    "HeadKind",
    "LoadsTPSlices",
    "LossFn",
    "NamedTensor",
    "Offloadable",
    "RolloutEngine",
    "SamplingParams",
    "TrainingEngine",
    "WeightMapping",
    "assemble_rollout",
    "filter_logits",
    "iter_buckets",
    "lr_factor",
    "select_tokens",
    "tensor_nbytes",
    "to_dtype",
]
