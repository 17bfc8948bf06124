"""Engine interfaces: what a backend implements so core's role workers can drive it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_core.lazy_imports import lazy_package
from hf_core.renamed import PLAN_MEANS_PLACEMENT, renamed_attributes

if TYPE_CHECKING:
    from hf_core.engines.adapters import LoRAConfig as LoRAConfig
    from hf_core.engines.adapters import is_adapter_name as is_adapter_name
    from hf_core.engines.adapters import write_peft_folder as write_peft_folder
    from hf_core.engines.capabilities import Closeable as Closeable
    from hf_core.engines.capabilities import DeclaresHostOverhead as DeclaresHostOverhead
    from hf_core.engines.capabilities import DeclaresNodeSharedMemory as DeclaresNodeSharedMemory
    from hf_core.engines.capabilities import DeclaresSequenceCapacity as DeclaresSequenceCapacity
    from hf_core.engines.capabilities import DeclaresTrainingState as DeclaresTrainingState
    from hf_core.engines.capabilities import ExportsHF as ExportsHF
    from hf_core.engines.capabilities import GenerationRank as GenerationRank
    from hf_core.engines.capabilities import HasGenerationRank as HasGenerationRank
    from hf_core.engines.capabilities import HasWorkerMesh as HasWorkerMesh
    from hf_core.engines.capabilities import LoadsTPSlices as LoadsTPSlices
    from hf_core.engines.capabilities import Offloadable as Offloadable
    from hf_core.engines.capabilities import ReshardsWeights as ReshardsWeights
    from hf_core.engines.capabilities import ServesAdapters as ServesAdapters
    from hf_core.engines.capabilities import TrainsAdapters as TrainsAdapters
    from hf_core.engines.decoding import ResponseSteps as ResponseSteps
    from hf_core.engines.decoding import expand_prompts as expand_prompts
    from hf_core.engines.decoding import left_padded as left_padded
    from hf_core.engines.decoding import pack_responses as pack_responses
    from hf_core.engines.decoding import strip_left_padding as strip_left_padding
    from hf_core.engines.dtypes import DTypeName as DTypeName
    from hf_core.engines.dtypes import HeadKind as HeadKind
    from hf_core.engines.dtypes import to_dtype as to_dtype
    from hf_core.engines.hf_folder import SpecialTokens as SpecialTokens
    from hf_core.engines.hf_folder import check_model_folder as check_model_folder
    from hf_core.engines.hf_folder import save_hf_folder as save_hf_folder
    from hf_core.engines.hf_folder import special_tokens as special_tokens
    from hf_core.engines.hf_folder import token_ids as token_ids
    from hf_core.engines.hf_folder import weight_files as weight_files
    from hf_core.engines.memory import ReleasesTaggedMemory as ReleasesTaggedMemory
    from hf_core.engines.memory import TaggedMemory as TaggedMemory
    from hf_core.engines.metric_rows import combine_metric_rows as combine_metric_rows
    from hf_core.engines.metric_rows import rank_zero_row as rank_zero_row
    from hf_core.engines.metric_rows import worst_rank as worst_rank
    from hf_core.engines.micro_batches import MicroBatch as MicroBatch
    from hf_core.engines.micro_batches import restore_outputs as restore_outputs
    from hf_core.engines.micro_batches import split_micro_batches as split_micro_batches
    from hf_core.engines.process_state import preserve_process_state as preserve_process_state
    from hf_core.engines.process_state import torch_threads as torch_threads
    from hf_core.engines.rollout import PROMPT_KEYS as PROMPT_KEYS
    from hf_core.engines.rollout import RolloutEngine as RolloutEngine
    from hf_core.engines.rollout import SamplingParams as SamplingParams
    from hf_core.engines.rollout import assemble_rollout as assemble_rollout
    from hf_core.engines.sampling import filter_logits as filter_logits
    from hf_core.engines.sampling import select_tokens as select_tokens
    from hf_core.engines.schedule import lr_factor as lr_factor
    from hf_core.engines.training import LossFn as LossFn
    from hf_core.engines.training import TrainingEngine as TrainingEngine
    from hf_core.engines.training_config import TrainingEngineConfig as TrainingEngineConfig
    from hf_core.engines.weights import CanonicalSlice as CanonicalSlice
    from hf_core.engines.weights import NamedTensor as NamedTensor
    from hf_core.engines.weights import WeightMapping as WeightMapping
    from hf_core.engines.weights import iter_buckets as iter_buckets
    from hf_core.engines.weights import tensor_nbytes as tensor_nbytes
# The re-exports above; the typed ones load on first use (hf_core.lazy_imports).
__all__, __getattr__, __dir__ = lazy_package(__name__)
if not TYPE_CHECKING:  # a retired name is refused naming the new one (hf_core.renamed)
    __getattr__ = renamed_attributes(
        __name__,
        {"plan_micro_batches": "split_micro_batches"},
        PLAN_MEANS_PLACEMENT,
        fallback=__getattr__,
    )
