"""Optional engine features, declared as small runtime-checkable protocols.

The two engine interfaces (:class:`~hf_core.engines.TrainingEngine`,
:class:`~hf_core.engines.RolloutEngine`) hold what every engine does.  What only some engines
can do is a protocol here; an engine has the capability by implementing its methods, and core
asks ``isinstance(engine, Capability)`` -- never ``getattr`` -- so a misspelt or mistyped
method is caught by the type checker and by the conformance kit, not silently skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import AbstractContextManager

    from hf_core.engines.adapters import LoRAConfig
    from hf_core.engines.weights import CanonicalSlice, NamedTensor
    from hf_core.protocols.mesh import WorkerMesh
    from hf_core.resharding import GenerationLayout, ParallelLayout, ReshardPlan, ReshardReport


@dataclass(frozen=True)
class GenerationRank:
    """One rank's place among the rollout engine's replicas (micro-DP) and its TP group."""

    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def of(cls, layout: GenerationLayout, rank: int, world: int) -> GenerationRank:
        """A rank's place under a resolved generation layout (``p_g = 1``: TP groups only)."""
        if layout.pp != 1:
            raise ValueError(f"{layout}: generation pipeline stages are not supported")
        engine, engines, inside = layout.place(rank, world)
        return cls(dp_rank=engine, dp_size=engines, tp_rank=inside, tp_size=layout.tp)

    @property
    def is_collect_rank(self) -> bool:
        """The rank whose output stands for its engine (generation TP rank 0)."""
        return self.tp_rank == 0


@runtime_checkable
class HasWorkerMesh(Protocol):
    """A training engine with model parallelism (TP/PP) reports its rank's coordinates.

    Without it a role worker assumes plain data parallelism over the whole group.
    """

    def worker_mesh(self) -> WorkerMesh: ...


@runtime_checkable
class HasGenerationRank(Protocol):
    """A rollout engine whose replicas span several ranks (generation TP ``t_g > 1``).

    Core's ``3D_ALL_MICRO_DP`` protocol routes one prompt chunk to each replica with it.
    """

    def generation_rank(self) -> GenerationRank: ...


@runtime_checkable
class LoadsTPSlices(Protocol):
    """A rollout engine whose ``load_weights`` takes :class:`CanonicalSlice` items: whole
    tensors or this rank's generation-TP slices, copied into its own shard as they are.

    Its generation layout ``(p_g, t_g)`` is what a reshard plan maps the training layout onto.
    """

    def generation_layout(self) -> GenerationLayout: ...


@runtime_checkable
class ReshardsWeights(Protocol):
    """A model-parallel training engine that runs the 3D-HybridEngine transition itself.

    ``parallel_layout`` is its training mesh ``(p, t, d)``; ``export_slices`` streams this
    rank's generation shard for core's plan (every rank of the group calls it together; the
    all-gathers run inside), and ``last_reshard`` says what the last transition moved.
    """

    def parallel_layout(self) -> ParallelLayout: ...

    def export_slices(
        self, bucket_bytes: int, plan: ReshardPlan
    ) -> Iterator[list[CanonicalSlice]]: ...

    def last_reshard(self) -> ReshardReport | None: ...


@runtime_checkable
class ExportsHF(Protocol):
    """A training engine that writes its model as a HuggingFace folder ``from_pretrained`` loads."""

    def export_hf(self, path: Path, tokenizer: str | Path | None = None) -> Path: ...


@runtime_checkable
class Offloadable(Protocol):
    """A training engine that moves parameters, gradients and optimiser state off the device.

    ``offload`` before generation frees the accelerator for the rollout engine; ``onload``
    brings them back before the next forward or update.  Both return the bytes moved -- on a
    CPU-only run, where nothing moves, the bytes they would move -- so the hand-over is
    measured the same way everywhere.
    """

    def offload(self) -> int: ...

    def onload(self) -> int: ...


@runtime_checkable
class Closeable(Protocol):
    """An engine holding processes, process groups or files that must be released at the end."""

    def close(self) -> None: ...


@runtime_checkable
class TrainsAdapters(Protocol):
    """A training engine that can train LoRA adapters over frozen base weights.

    ``lora_config`` is ``None`` when this engine was built without adapters (then the other
    methods do not apply).  With adapters, ``export_weights`` streams *merged* weights,
    ``export_adapters`` only the adapters (canonical adapter names, see
    :mod:`hf_core.engines.adapters`), and inside ``adapters_disabled()`` every forward is
    the base model's -- the reference policy without a second copy of the base weights.
    Every rank calls the exports together (they gather shards).
    """

    def lora_config(self) -> LoRAConfig | None: ...

    def adapters_disabled(self) -> AbstractContextManager[None]: ...

    def export_adapters(self, bucket_bytes: int) -> Iterator[list[NamedTensor]]: ...

    def export_adapter_folder(self, path: Path) -> Path: ...


@runtime_checkable
class ServesAdapters(Protocol):
    """A rollout engine that can generate with a LoRA adapter over its (unchanged) base weights.

    ``serves_adapters`` says whether it was built to serve this adapter (vLLM needs LoRA
    enabled and a large enough rank when it starts); if so, ``load_adapter`` replaces the
    adapter every following ``generate`` uses and the weight sync moves only the adapters.
    """

    def serves_adapters(self, config: LoRAConfig) -> bool: ...

    def load_adapter(self, config: LoRAConfig, tensors: list[NamedTensor]) -> None: ...


@runtime_checkable
class DeclaresTrainingState(Protocol):
    """A training engine's *settings* that know the bytes one rank holds for its weights,
    gradients and optimizer state.

    The pre-start memory check otherwise assumes FSDP's sharding: four copies (weights,
    gradients, Adam's two moments) in the parameter dtype, all sharded over every rank.  An
    engine that keeps float32 master weights and gradients for 16-bit parameters, or shards
    its weights over model-parallel ranks only, says so here.
    """

    def state_bytes_per_rank(self, num_params: int, ranks: int, trainable: bool) -> int:
        """Bytes of weights, gradients and optimizer state on one of ``ranks`` processes
        holding a model of ``num_params`` parameters (``trainable=False``: weights only)."""
        ...


@runtime_checkable
class DeclaresNodeSharedMemory(Protocol):
    """A training engine's *settings* that know what its ranks on one CPU node hold together,
    outside any one process (e.g. a ``/dev/shm`` file their collectives copy through).  The
    pre-start memory check shares it among the node's processes."""

    def node_shared_bytes(self, ranks_per_node: int) -> int:
        """Bytes the engine's ``ranks_per_node`` ranks on one node hold together."""
        ...


@runtime_checkable
class DeclaresRoutedExperts(Protocol):
    """A rollout engine's *settings* that say whether the engine returns a mixture-of-experts
    model's routing (``SamplingParams.routed_experts``; routing replay).  Settings without it
    belong to an engine that does not: the pre-start check then refuses routing replay."""

    def routed_experts_unsupported(self) -> str | None:
        """``None`` when the engine returns each token's experts; else why it cannot here."""
        ...


@runtime_checkable
class DeclaresSequenceCapacity(Protocol):
    """A rollout engine's *settings* that bound one sequence's length (prompt + response):
    a KV cache of fixed size, or a length limit of the engine's own.

    Checked before the run starts (:mod:`hf_core.trainer.sequence_length`): a response that
    could never fit is a configuration error naming the setting, not an engine failure in
    the middle of the first rollout.
    """

    def sequence_capacity(self, kv_elements_per_token: int) -> tuple[int, str] | None:
        """The most tokens one sequence may hold and the setting that bounds it (``None``:
        no fixed bound); ``kv_elements_per_token``: K and V values one token adds over all
        layers of the model."""
        ...


@runtime_checkable
class DeclaresHostOverhead(Protocol):
    """A rollout engine's *settings* that know what the engine holds in a CPU process beyond
    its weights (KV cache, the engine's own runtime).

    The pre-start memory check (:mod:`hf_core.trainer.memory_check`) asks the validated
    ``rollout.engine`` block, so it can refuse a run before the engine is built instead of
    the kernel killing it mid-build.  Settings without it count the weights and an explicit
    ``kv_cache_bytes`` only.
    """

    def host_overhead_bytes(self) -> int:
        """Bytes the engine keeps resident in its process on the CPU, weights excluded."""
        ...

    def training_overhead_bytes(self) -> int:
        """Of those, the bytes still resident while the training engine updates (an engine
        that hands its KV cache back during training declares less than the above)."""
        ...
