"""Canonical (HF) tensors -> vLLM, in place: which names exist, and which must travel together.

vLLM reloads weights layer by layer (``reload_weights`` -> layerwise reload): each call moves
every layer to ``meta``, loads what the call carries and puts the untouched layers back.  A
layer that receives only *part* of its tensors in a call is rebuilt from the part it got and
uninitialised memory for the rest.  vLLM fuses several HF tensors into one layer (q/k/v ->
``qkv_proj``, gate/up -> ``gate_up_proj``, a projection's weight and bias, MoE experts), so a
bucket boundary that falls between ``q_proj`` and ``k_proj`` would corrupt the layer.

:class:`FusedGroupBuffer` therefore holds tensors back until every canonical tensor of their
vLLM layer has arrived, then releases the whole group.  The extra memory this costs is at most
one fused group (a few tensors of one decoder layer), never a second copy of the model.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hf_core.engines import CanonicalSlice, NamedTensor, tensor_nbytes
from hf_core.engines.model_classes import checkpoint_shapes
from hf_core.sync import SyncStats
from hf_vllm.tp_slices import TPRange, VLLMPartition, range_mismatch

if TYPE_CHECKING:
    from hf_core.engines import RolloutEngine, TrainingEngine

DEFAULT_PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""vLLM's fusions for Llama-style models (used when the model class declares none)."""

_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")


def reload_group(name: str, packed: Mapping[str, Iterable[str]]) -> str:
    """The vLLM layer a canonical tensor is loaded into (tensors with equal keys go together)."""
    expert = _EXPERT.match(name)
    if expert:  # FusedMoE: one layer holds every expert's weights
        return expert.group(1)
    module, _, _ = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


@dataclass(frozen=True)
class CanonicalParams:
    """The canonical tensors a model has: names, shapes, and tied aliases nobody sends."""

    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied alias -> the name its tensor travels under (``lm_head.weight`` -> embedding)."""


def canonical_params(folder: str | Path) -> CanonicalParams:
    """Names and shapes of the HF model in ``folder``, from a model built on ``meta``.

    These are exactly the names a training engine exports (HF state-dict names, a tied
    ``lm_head.weight`` folded into the embedding), so every bucket can be checked on arrival.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    owner_of: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owner_of:
            aliases[name] = owner_of[id(param)]
            continue
        owner_of[id(param)] = name
    # the checkpoint's names: a mixture of experts' fused tensors as one tensor per expert
    shapes = checkpoint_shapes(model, owner_of.values())
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                shapes[f"{module_name}.{name}" if module_name else name] = tuple(buf.shape)
    return CanonicalParams(shapes, aliases)


class ReadyTensor(NamedTuple):
    """A tensor released to vLLM: whole, or (``sharded``) this rank's block of it."""

    name: str
    tensor: torch.Tensor
    sharded: bool = False


class FusedGroupBuffer:
    """Releases canonical tensors only as complete vLLM layers (see the module docstring).

    Items are whole ``(name, tensor)`` pairs or :class:`~hf_core.engines.CanonicalSlice`
    blocks.  A block must be exactly the one ``partition`` gives TP rank ``tp_rank`` (checked
    on arrival, with the expected shape); a whole tensor of a vLLM parameter that also gets
    blocks in the same layer is narrowed to this rank's block (a view), so each parameter is
    loaded one way.
    """

    def __init__(
        self,
        params: CanonicalParams,
        packed: Mapping[str, Iterable[str]],
        partition: VLLMPartition | None = None,
        tp_rank: int = 0,
    ) -> None:
        self.params = params
        self.partition = partition
        self.tp_rank = tp_rank
        self.group_of = {name: reload_group(name, packed) for name in params.shapes}
        self.members: dict[str, set[str]] = {}
        for name, group in self.group_of.items():
            self.members.setdefault(group, set()).add(name)
        self.pending: dict[str, dict[str, ReadyTensor]] = {}
        self.released: set[str] = set()
        """Canonical names handed to vLLM since the last :meth:`clear` (one sync)."""

    def add(self, bucket: Iterable[NamedTensor | CanonicalSlice]) -> list[ReadyTensor]:
        """Take one bucket; return every tensor whose layer is now complete, in arrival order.

        The whole bucket is checked first, so a bucket with a bad item changes nothing.
        """
        arrived = [self._check(item) for item in bucket]
        ready: list[ReadyTensor] = []
        for item in arrived:
            if item is None:
                continue  # a tied alias: its tensor arrives under the owner's name
            group = self.group_of[item.name]
            held = self.pending.setdefault(group, {})
            held[item.name] = item
            if held.keys() == self.members[group]:
                ready.extend(self._one_way(list(self.pending.pop(group).values())))
        self.released.update(item.name for item in ready)
        return ready

    def _check(self, item: NamedTensor | CanonicalSlice) -> ReadyTensor | None:
        """One item as it will be loaded (``None``: a tied alias, skipped); raises if vLLM
        has no such tensor or it does not fit."""
        if isinstance(item, CanonicalSlice):
            if item.name in self.params.aliases:
                return None
            return self._check_slice(item)
        name, tensor = item
        if name in self.params.aliases:
            return None
        self._check_whole(name, tensor)
        return ReadyTensor(name, tensor)

    def _shape(self, name: str) -> tuple[int, ...]:
        shape = self.params.shapes.get(name)
        if shape is None:
            raise KeyError(f"the rollout model has no parameter {name!r}")
        return shape

    def _check_whole(self, name: str, tensor: torch.Tensor) -> None:
        shape = self._shape(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, rollout model has {shape}")

    def _check_slice(self, item: CanonicalSlice) -> ReadyTensor:
        """A whole slice as a whole tensor; a block only if it is this rank's vLLM block."""
        shape = self._shape(item.name)
        if tuple(item.full_shape) != shape:
            raise ValueError(
                f"{item.name}: slice of a tensor of shape {tuple(item.full_shape)}, rollout "
                f"model has {shape}"
            )
        if item.is_full:
            self._check_whole(item.name, item.tensor)
            return ReadyTensor(item.name, item.tensor)
        assert item.dim is not None
        got = (item.dim, item.start, item.stop)
        part = self.partition
        if part is None:
            raise ValueError(f"{item.name}: got a TP slice {_block(got)}; whole tensors only here")
        want = part.tp_range(item.name, shape, self.tp_rank)
        if want != got:
            raise range_mismatch(item.name, got, want, part, self.tp_rank)
        expected = list(shape)
        expected[item.dim] = item.stop - item.start
        if list(item.tensor.shape) != expected:
            raise ValueError(
                f"{item.name}: TP slice of shape {tuple(item.tensor.shape)}, this rank's block "
                f"{_block(got)} has shape {tuple(expected)}"
            )
        return ReadyTensor(item.name, item.tensor, sharded=True)

    def _one_way(self, group: list[ReadyTensor]) -> list[ReadyTensor]:
        """Narrow whole tensors of a vLLM parameter that also receives blocks (q whole, k and
        v as blocks -> all blocks): vLLM's loader takes one parameter one way."""
        sharded_leaves = {item.name.rpartition(".")[2] for item in group if item.sharded}
        if not sharded_leaves or self.partition is None:
            return group
        out = []
        for item in group:
            block = None
            if not item.sharded and item.name.rpartition(".")[2] in sharded_leaves:
                shape = self.params.shapes[item.name]
                block = self.partition.tp_range(item.name, shape, self.tp_rank)
            if block is None:
                out.append(item)
            else:
                dim, start, stop = block
                part = item.tensor.narrow(dim, start, stop - start)
                out.append(ReadyTensor(item.name, part, sharded=True))
        return out

    def stale_aliases(self) -> list[str]:
        """Tied aliases whose owner was reloaded this sync (their vLLM layer must re-pack)."""
        return sorted(a for a, owner in self.params.aliases.items() if owner in self.released)

    @property
    def pending_bytes(self) -> int:
        return sum(
            tensor_nbytes(item.tensor) for held in self.pending.values() for item in held.values()
        )

    def missing(self) -> dict[str, list[str]]:
        """Layers that got some tensors but not all: layer -> the canonical names not sent."""
        return {
            group: sorted(self.members[group] - held.keys()) for group, held in self.pending.items()
        }

    def clear(self) -> None:
        self.pending.clear()
        self.released.clear()


def _block(block: TPRange) -> str:
    return f"dim {block[0]} [{block[1]}, {block[2]})"


@dataclass
class VLLMSyncStats(SyncStats):
    """Core's sync numbers plus what the fused-layer buffering costs."""

    reload_calls: int = 0
    max_held_bytes: int = 0
    """Largest amount of tensor data held back waiting for the rest of a fused layer."""


def sync_weights(
    source: TrainingEngine, target: RolloutEngine, bucket_bytes: int
) -> dict[str, Any]:
    """Stream ``source``'s canonical weights into ``target`` (hybrid mode, same process).

    Every rank of the training group must call this together (exports are collectives).
    Returns the target's :meth:`~hf_core.engines.RolloutEngine.sync_metrics`, or the wall
    time when it measures none.
    """
    start = time.perf_counter()
    for bucket in source.export_weights(bucket_bytes):
        target.load_weights(bucket)
    target.finish_weight_sync()
    return target.sync_metrics() or {"weight_sync/seconds": time.perf_counter() - start}
