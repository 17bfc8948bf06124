"""Engine interfaces: what a backend implements so core's role workers can drive it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_core.lazy_imports import lazy_exports

if TYPE_CHECKING:
    from hf_core.engines.adapters import LoRAConfig, is_adapter_name, write_peft_folder
    from hf_core.engines.capabilities import (
        Closeable,
        DeclaresHostOverhead,
        DeclaresNodeSharedMemory,
        DeclaresSequenceCapacity,
        DeclaresTrainingState,
        ExportsHF,
        GenerationRank,
        HasGenerationRank,
        HasWorkerMesh,
        LoadsTPSlices,
        Offloadable,
        ReshardsWeights,
        ServesAdapters,
        TrainsAdapters,
    )
    from hf_core.engines.decoding import (
        ResponseSteps,
        expand_prompts,
        left_padded,
        pack_responses,
        strip_left_padding,
    )
    from hf_core.engines.dtypes import DTypeName, HeadKind, to_dtype
    from hf_core.engines.hf_folder import (
        SpecialTokens,
        check_model_folder,
        save_hf_folder,
        special_tokens,
        token_ids,
        weight_files,
    )
    from hf_core.engines.memory import ReleasesTaggedMemory, TaggedMemory
    from hf_core.engines.metric_rows import combine_metric_rows, rank_zero_row, worst_rank
    from hf_core.engines.micro_batches import MicroBatch, plan_micro_batches, restore_outputs
    from hf_core.engines.process_state import preserve_process_state, torch_threads
    from hf_core.engines.rollout import PROMPT_KEYS, RolloutEngine, SamplingParams, assemble_rollout
    from hf_core.engines.sampling import filter_logits, select_tokens
    from hf_core.engines.schedule import lr_factor
    from hf_core.engines.training import LossFn, TrainingEngine
    from hf_core.engines.training_config import TrainingEngineConfig
    from hf_core.engines.weights import (
        CanonicalSlice,
        NamedTensor,
        WeightMapping,
        iter_buckets,
        tensor_nbytes,
    )

__all__ = [
    "PROMPT_KEYS",
    "CanonicalSlice",
    "Closeable",
    "DTypeName",
    "DeclaresHostOverhead",
    "DeclaresNodeSharedMemory",
    "DeclaresSequenceCapacity",
    "DeclaresTrainingState",
    "ExportsHF",
    "GenerationRank",
    "HasGenerationRank",
    "HasWorkerMesh",
    "HeadKind",
    "LoRAConfig",
    "LoadsTPSlices",
    "LossFn",
    "MicroBatch",
    "NamedTensor",
    "Offloadable",
    "ReleasesTaggedMemory",
    "ReshardsWeights",
    "ResponseSteps",
    "RolloutEngine",
    "SamplingParams",
    "ServesAdapters",
    "SpecialTokens",
    "TaggedMemory",
    "TrainingEngine",
    "TrainingEngineConfig",
    "TrainsAdapters",
    "WeightMapping",
    "assemble_rollout",
    "check_model_folder",
    "combine_metric_rows",
    "expand_prompts",
    "filter_logits",
    "is_adapter_name",
    "iter_buckets",
    "left_padded",
    "lr_factor",
    "pack_responses",
    "plan_micro_batches",
    "preserve_process_state",
    "rank_zero_row",
    "restore_outputs",
    "save_hf_folder",
    "select_tokens",
    "special_tokens",
    "strip_left_padding",
    "tensor_nbytes",
    "to_dtype",
    "token_ids",
    "torch_threads",
    "weight_files",
    "worst_rank",
    "write_peft_folder",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "adapters": ("LoRAConfig", "is_adapter_name", "write_peft_folder"),
        "capabilities": (
            "Closeable",
            "DeclaresHostOverhead",
            "DeclaresNodeSharedMemory",
            "DeclaresSequenceCapacity",
            "DeclaresTrainingState",
            "ExportsHF",
            "GenerationRank",
            "HasGenerationRank",
            "HasWorkerMesh",
            "LoadsTPSlices",
            "Offloadable",
            "ReshardsWeights",
            "ServesAdapters",
            "TrainsAdapters",
        ),
        "decoding": (
            "ResponseSteps",
            "expand_prompts",
            "left_padded",
            "pack_responses",
            "strip_left_padding",
        ),
        "dtypes": ("DTypeName", "HeadKind", "to_dtype"),
        "hf_folder": (
            "SpecialTokens",
            "check_model_folder",
            "save_hf_folder",
            "special_tokens",
            "token_ids",
            "weight_files",
        ),
        "memory": ("ReleasesTaggedMemory", "TaggedMemory"),
        "metric_rows": ("combine_metric_rows", "rank_zero_row", "worst_rank"),
        "micro_batches": ("MicroBatch", "plan_micro_batches", "restore_outputs"),
        "process_state": ("preserve_process_state", "torch_threads"),
        "rollout": ("PROMPT_KEYS", "RolloutEngine", "SamplingParams", "assemble_rollout"),
        "sampling": ("filter_logits", "select_tokens"),
        "schedule": ("lr_factor",),
        "training": ("LossFn", "TrainingEngine"),
        "training_config": ("TrainingEngineConfig",),
        "weights": (
            "CanonicalSlice",
            "NamedTensor",
            "WeightMapping",
            "iter_buckets",
            "tensor_nbytes",
        ),
    },
)
