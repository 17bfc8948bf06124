"""Generation-TP slices: which block of a canonical tensor vLLM gives a TP rank, and loading
such pre-sliced blocks through vLLM's own weight loaders.

A model-parallel training engine (megatron, TP = t) can hand each rank of a ``t_g``-way vLLM
engine just that rank's block of every split tensor (a :class:`~hf_core.engines.CanonicalSlice`),
so no rank ever holds the full tensor.  That only works if the block is exactly the one vLLM's
partition puts on the rank; :class:`VLLMPartition` says which one that is, without importing
vLLM (so it is unit-testable and the error for a mismatch can name both ranges).

Loading: vLLM's loaders always narrow a *whole* tensor to the rank's block.  Within its
layerwise ``reload_weights`` (which re-creates each layer from its load-time parameters, loads
into them and re-runs the weight post-processing, e.g. the CPU GEMM repacking) the block is
handed to the same loaders with each target told the tensor is already this rank's shard
(:func:`reload_presharded`).  Fused qkv / gate_up layers and post-processing therefore work
exactly as for whole tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_core.engines import NamedTensor

VOCAB_PADDING = 64
"""vLLM pads the vocabulary of ``VocabParallelEmbedding`` / ``ParallelLMHead`` to a multiple of
this (its ``DEFAULT_VOCAB_PADDING_SIZE``) and splits the padded rows evenly over TP ranks."""

TPRange = tuple[int, int, int]
"""``(dim, start, stop)`` of a rank's block in a canonical tensor."""

_COLUMN = ("q_proj", "gate_proj", "up_proj")
_KV = ("k_proj", "v_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


def _module_of(name: str) -> tuple[str, str]:
    """``(leaf module, parameter)`` of a canonical name: ``q_proj``, ``weight``."""
    module, _, param = name.rpartition(".")
    return module.rpartition(".")[2], param


def _even_block(size: int, tp_size: int, tp_rank: int, name: str, dim: int) -> tuple[int, int]:
    """This rank's contiguous block when ``size`` splits evenly (vLLM asserts it does)."""
    if size % tp_size:
        raise ValueError(f"{name}: dim {dim} of size {size} does not split over {tp_size} ranks")
    per = size // tp_size
    return tp_rank * per, (tp_rank + 1) * per


@dataclass(frozen=True)
class VLLMPartition:
    """How vLLM's tensor parallelism splits one model's canonical (HF) tensors.

    Column-parallel q/gate/up (and q/k/v biases) split along dim 0, row-parallel o/down
    weights along dim 1 (their biases are replicated), k/v by KV heads (each of several ranks
    holds a copy of one head when there are fewer KV heads than ranks), vocabulary rows of the
    embedding and LM head over the vocabulary padded to :data:`VOCAB_PADDING`; everything
    else (norms) is whole on every rank.
    """

    tp_size: int
    vocab_size: int
    num_kv_heads: int
    vocab_padding: int = VOCAB_PADDING

    @classmethod
    def from_hf_config(cls, config: Any, tp_size: int) -> VLLMPartition:
        """The partition of a transformers config (its text config for multimodal ones)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        return cls(tp_size, text.vocab_size, getattr(text, "num_key_value_heads", None) or heads)

    @property
    def padded_vocab(self) -> int:
        """Vocabulary rows vLLM allocates over all ranks (real rows, then zero padding)."""
        pad = self.vocab_padding
        return -(-self.vocab_size // pad) * pad

    def tp_range(self, name: str, full_shape: Sequence[int], tp_rank: int) -> TPRange | None:
        """The block of canonical tensor ``name`` that TP rank ``tp_rank`` holds, or ``None``
        when every rank holds it whole."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside a {self.tp_size}-way engine")
        if self.tp_size == 1:
            return None
        module, param = _module_of(name)
        if module in _VOCAB and param == "weight":
            per = self.padded_vocab // self.tp_size
            start, stop = tp_rank * per, (tp_rank + 1) * per
            return 0, min(start, self.vocab_size), min(stop, self.vocab_size)
        if module in _COLUMN:
            return 0, *_even_block(full_shape[0], self.tp_size, tp_rank, name, 0)
        if module in _KV:
            return 0, *self._kv_block(full_shape[0], tp_rank)
        if module in _ROW and param == "weight":
            return 1, *_even_block(full_shape[1], self.tp_size, tp_rank, name, 1)
        return None

    def _kv_block(self, rows: int, tp_rank: int) -> tuple[int, int]:
        """k/v rows by KV heads; with fewer heads than ranks, rank r holds head
        ``r // (tp / heads)`` (vLLM replicates KV heads)."""
        heads, tp = self.num_kv_heads, self.tp_size
        head_dim = rows // heads
        if heads >= tp:
            per = heads // tp * head_dim
            return tp_rank * per, (tp_rank + 1) * per
        head = tp_rank // (tp // heads)
        return head * head_dim, (head + 1) * head_dim

    def local_shape(self, name: str, full_shape: Sequence[int], tp_rank: int) -> tuple[int, ...]:
        """The shape vLLM allocates on this rank for ``name`` (vocabulary: padded rows too)."""
        shape = list(full_shape)
        block = self.tp_range(name, full_shape, tp_rank)
        if block is not None:
            dim, start, stop = block
            vocab = _module_of(name)[0] in _VOCAB
            shape[dim] = self.padded_vocab // self.tp_size if vocab else stop - start
        return tuple(shape)

    def shard_bytes(
        self, shapes: Mapping[str, Sequence[int]], tp_rank: int, element_size: int
    ) -> int:
        """Bytes of this rank's shard of every tensor in ``shapes`` (tied aliases excluded by
        the caller).  Counted from shapes: on CPU vLLM repacks linear weights into kernel
        handles and leaves empty placeholder parameters, so the live model cannot tell."""
        total = 0
        for name, shape in shapes.items():
            numel = 1
            for size in self.local_shape(name, shape, tp_rank):
                numel *= size
            total += numel * element_size
        return total


def range_mismatch(
    name: str, got: TPRange | None, want: TPRange | None, partition: VLLMPartition, tp_rank: int
) -> ValueError:
    """The error for a slice whose block is not the one vLLM gives this rank, with the fix."""
    fix = "send this tensor whole, or sliced exactly as vLLM partitions it"
    if _module_of(name)[0] in _VOCAB:
        fix = (
            f"vLLM pads the vocabulary ({partition.vocab_size}) to {partition.padded_vocab} rows "
            f"(a multiple of {partition.vocab_padding}) and splits them evenly over "
            f"{partition.tp_size} ranks; pad the training engine's vocabulary the same way "
            f"(megatron: make_vocab_size_divisible_by = {partition.vocab_padding} / its "
            "tensor-parallel size)"
        )
    return ValueError(
        f"{name}: TP slice {_show(got)} does not match the block vLLM's partition gives TP rank "
        f"{tp_rank} of {partition.tp_size}, {_show(want)}; nothing was gathered or loaded. "
        f"Fix: {fix}"
    )


def _show(block: TPRange | None) -> str:
    return "whole (replicated)" if block is None else f"dim {block[0]} [{block[1]}, {block[2]})"


# --------------------------------------------------------------------- worker side (vLLM)
def vllm_param_name(group: str, canonical: str) -> str:
    """The vLLM parameter a canonical tensor loads into: its reload group's ``weight``/``bias``
    (``...q_proj.weight`` -> ``...qkv_proj.weight``)."""
    return f"{group}.{canonical.rpartition('.')[2]}"


def _take_as_shard(model: torch.nn.Module, name: str) -> Callable[[], None]:
    """Tell vLLM's loader of parameter ``name`` that what it gets is this rank's shard.

    Returns the undo.  Called while ``reload_weights`` has the layer's load-time parameters
    in place (the objects its loaders receive):

    * linear weights (``BasevLLMParameter``) narrow at ``param.tp_rank * shard``: with
      ``tp_rank`` 0 the block is taken as is -- how vLLM loads its replicated (``disable_tp``)
      weights;
    * plain linear parameters (biases) use vLLM's own ``is_sharded_weight`` flag, which its
      loaders read for pre-sharded checkpoints;
    * vocabulary layers narrow to their ``shard_indices`` and check the full vocabulary:
      they are told their real rows start at 0 and number exactly the block's rows.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.parameter import BasevLLMParameter

    module_name, _, leaf = name.rpartition(".")
    layer = model.get_submodule(module_name)
    param = getattr(layer, leaf)
    if isinstance(layer, VocabParallelEmbedding):
        return _vocab_as_shard(layer)
    if isinstance(param, BasevLLMParameter):
        if not param.is_meta:
            raise RuntimeError(
                f"{name} is not in its load-time form inside vLLM's reload_weights (this vLLM "
                "reloads differently from the version hf-vllm was written for): slices cannot "
                "be loaded"
            )
        rank = param.tp_rank
        param.tp_rank = 0
        return lambda: setattr(param, "tp_rank", rank)
    if isinstance(layer, LinearBase):
        had, old = hasattr(param, "is_sharded_weight"), getattr(param, "is_sharded_weight", None)
        param.is_sharded_weight = True  # type: ignore[attr-defined]

        def undo() -> None:
            if had:
                param.is_sharded_weight = old  # type: ignore[attr-defined]
            else:
                del param.is_sharded_weight  # type: ignore[attr-defined]

        return undo
    raise ValueError(f"hf-vllm cannot load a TP slice into {name} ({type(layer).__name__})")


def _vocab_as_shard(layer: Any) -> Callable[[], None]:
    """Make a vocabulary layer's loader take this rank's real rows as the whole vocabulary."""
    indices, org = layer.shard_indices, layer.org_vocab_size
    rows = indices.org_vocab_end_index - indices.org_vocab_start_index
    layer.shard_indices = dataclasses.replace(
        indices, org_vocab_start_index=0, org_vocab_end_index=rows
    )
    layer.org_vocab_size = rows

    def undo() -> None:
        layer.shard_indices, layer.org_vocab_size = indices, org

    return undo


def reload_presharded(worker: Any, weights: list[NamedTensor], presharded: list[str]) -> None:
    """Run on the vLLM worker (``collective_rpc``): vLLM's layerwise ``reload_weights`` of
    ``weights``, where the vLLM parameters named in ``presharded`` receive this rank's blocks.

    ``reload_weights`` first puts every layer's load-time parameters back, then consumes the
    weights: the parameters are marked when the first weight is drawn (they are the ones the
    loaders see, and are copied into the layer that gets loaded and post-processed) and
    restored once the reload, including its deferred processing, has finished.
    """
    model = worker.model_runner.get_model()
    undo: list[Callable[[], None]] = []

    def stream() -> Iterator[NamedTensor]:
        for name in presharded:
            undo.append(_take_as_shard(model, name))
        yield from weights

    try:
        worker.reload_weights(weights_iterator=stream())
    finally:
        for restore in reversed(undo):
            restore()
