"""The 3D-HybridEngine transition (HybridFlow §5.4): training layout -> generation layout.

Core's plan (:mod:`hf_core.resharding`) says, per rank, whom to all-gather with.  This module
turns it into collectives over this rank's megatron parameters:

1. Every rank's *training unit* (all its megatron parameters, in the order of
   :func:`hf_megatron.weight_mapping.rank_params`) is a flat sequence of ``numel`` elements.  Units
   are padded to the largest unit ``U`` of the model, so the model size the all-gathers move
   is ``M = p * t * U`` elements and every all-gather has equal-sized inputs.
2. The rank all-gathers within its plan's gather group only (a ``torch.distributed`` group
   made with ``new_group`` for each group of the plan), in chunks: one collective moves
   ``[lo, hi)`` of every member's unit, in place (the rank's own slot is the input).  Its own
   parameters are never received back and never gathered twice: the generation shard reads
   them where they are (``ReshardStats.reused_bytes`` counts the tensors handed over as views
   of the training parameters themselves).
3. As members' parameters complete, they are mapped to canonical pieces and assembled into
   what this rank's *generation shard* needs: whole canonical tensors (``t_g == 1``) or the
   generation TP rank's slices (megatron's / vLLM's partition).  Each chunk's completed
   tensors are yielded as one bucket, so the extra memory is about one chunk of the gather
   plus the tensors in flight -- never a second model.

Experts under expert parallelism (``ep > 1``, a mixture-of-experts model) are not part of
the training unit -- the ``ep`` ranks of one DP group hold different experts, not copies --
and move in a second phase (:class:`ExpertGather`, ``pp = 1``): per layer, one all-gather
over the expert tensor-and-expert-parallel group (``tp * ep`` ranks holding every expert's
TP slices once), in which each rank sends only its own experts and receives every other
rank's once (nothing is received twice).  Each rank's generation shard needs every expert of
its layers (whole, or its generation TP slice).

With the paper's plan a rank receives ``(d_g - 1) * U`` elements, ``(pt - t_g p_g) /
(t_g p_g pt) * M`` (Table 2), and everything it receives lies in its generation shard
(zero redundancy).  With the naive plan it receives ``(pt - 1) * U`` and keeps only its
slice.  :class:`ReshardStats` records what actually happened, for tests and the benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hf_core.resharding import (
    GenerationLayout,
    ParallelLayout,
    RankPlan,
    ReshardPlan,
    ReshardReport,
    Unit,
    build_hybrid_plan,
    build_naive_plan,
)
from hf_megatron.weight_mapping import (
    CanonicalSlice,
    ModelDims,
    NativeParam,
    RankPosition,
    rank_params,
    tp_slice_range,
)

_GROUPS: dict[tuple[tuple[int, ...], ...], dict[tuple[int, ...], dist.ProcessGroup]] = {}


def gather_group(plan: ReshardPlan, rank: int) -> dist.ProcessGroup:
    """This rank's gather group; every group of the plan is created (once) on every rank,
    in the same order, as ``new_group`` requires."""
    key = tuple(plan.gather_groups)
    if key not in _GROUPS:
        _GROUPS[key] = {group: dist.new_group(list(group)) for group in plan.gather_groups}
    return _GROUPS[key][plan.for_rank(rank).gather_group]


def resolve_plan(
    train: ParallelLayout, plan: RankPlan | ReshardPlan | None, rank: int
) -> ReshardPlan:
    """The whole plan for ``plan`` (``None``: every rank gathers the whole model).

    A :class:`RankPlan` alone (what ``TrainingEngine.export_weights`` receives) is matched
    against the hybrid and naive plans of the same layouts.
    """
    if plan is None:
        return build_hybrid_plan(train, GenerationLayout(pp=1, tp=1))
    if isinstance(plan, ReshardPlan):
        if plan.train != train:
            raise ValueError(f"plan is for {plan.train}, this engine's layout is {train}")
        return plan
    gen = GenerationLayout(pp=len(plan.gen_pp_group), tp=len(plan.gen_tp_group))
    for build in (build_hybrid_plan, build_naive_plan):
        full = build(train, gen)
        if full.for_rank(rank) == plan:
            return full
    raise ValueError(f"rank plan {plan} does not belong to the layout {train} at rank {rank}")


def _wchar() -> int:
    """Bytes this process wrote through the OS (sockets included): gloo's sends show here."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


@dataclass
class ReshardStats:
    """What one transition did on this rank (bytes are of the training dtype)."""

    kind: str
    rank: int
    gather_group: tuple[int, ...]
    element_size: int
    unit_numel: int
    """``U``: elements of the largest training unit (every unit is padded to it)."""
    model_numel: int
    """``M = p * t * U``: the model as the all-gathers move it."""
    real_model_numel: int
    """Sum of the units' real sizes (padding excluded, TP-replicated norms counted per rank)."""
    received_bytes: int = 0
    """Bytes of other ranks' units that landed in this rank's buffers."""
    sent_bytes: int = 0
    """Bytes of this rank's own unit it contributed (its send slot, each collective)."""
    wire_bytes_written: int = 0
    """``/proc/self/io`` wchar delta over the transition: what the OS saw this process send."""
    received_units: set[Unit] = field(default_factory=set)
    own_unit: Unit = (0, 0)
    reused_bytes: int = 0
    """Bytes of yielded tensors that are this rank's training parameters themselves (views,
    no copy): the training shard reused in the generation shard."""
    gen_units: set[Unit] = field(default_factory=set)
    collectives: int = 0
    peak_buffer_bytes: int = 0
    """Largest sum of live transition buffers: gather output, partial parameters, assembled
    slices not yet handed over."""
    emitted_tensors: int = 0
    emitted_bytes: int = 0
    seconds: float = 0.0
    expert_sent_bytes: int = 0
    """Expert parallelism: bytes of this rank's own experts it contributed (all-gathers)."""
    expert_received_bytes: int = 0
    """Expert parallelism: bytes of other ranks' experts received (``(ep - 1) / ep`` of
    the model's expert bytes, ``(tp ep - 1) / (tp ep)`` with tp > 1)."""

    @property
    def model_bytes(self) -> int:
        return self.model_numel * self.element_size

    @property
    def received_fraction(self) -> float:
        """Received bytes as a fraction of ``M`` (compare with Table 2)."""
        return self.received_bytes / self.model_bytes

    @property
    def redundant_units(self) -> set[Unit]:
        """Units received that are not part of this rank's generation shard."""
        return self.received_units - self.gen_units

    @property
    def zero_redundancy(self) -> bool:
        """Own unit inside the generation shard, and own unit + received = generation shard."""
        return (
            self.own_unit in self.gen_units
            and (self.received_units | {self.own_unit}) == self.gen_units
        )

    def report(self) -> ReshardReport:
        """This transition in core's terms (for the trainer's ``reshard/*`` metrics)."""
        return ReshardReport(
            kind=self.kind,
            received_bytes=self.received_bytes,
            model_bytes=self.model_bytes,
            peak_extra_bytes=self.peak_buffer_bytes,
            zero_redundancy=self.zero_redundancy,
            seconds=self.seconds,
            expert_received_bytes=self.expert_received_bytes,
        )

    def as_dict(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if not isinstance(v, set)}
        out["received_units"] = sorted(self.received_units)
        out["gen_units"] = sorted(self.gen_units)
        out["model_bytes"] = self.model_bytes
        out["received_fraction"] = self.received_fraction
        out["zero_redundancy"] = self.zero_redundancy
        return out


@dataclass
class _Target:
    """What this rank's generation shard needs of one canonical tensor."""

    name: str
    dim: int | None
    start: int
    stop: int
    full_shape: tuple[int, ...]
    buffer: torch.Tensor | None = None
    covered: int = 0
    done: bool = False


class SliceAssembler:
    """Collects canonical pieces into the generation shard's tensors (whole or TP slices)."""

    def __init__(self, targets: Mapping[str, _Target], dtype: torch.dtype) -> None:
        self.targets = dict(targets)
        self.ready: list[CanonicalSlice] = []
        self.duplicate_bytes = 0
        for target in self.targets.values():
            if target.dim is not None and target.start == target.stop:
                # e.g. a TP rank whose vocabulary rows are all padding: an empty slice
                shape = list(target.full_shape)
                shape[target.dim] = 0
                self._finish(target, torch.empty(shape, dtype=dtype))

    @property
    def buffer_bytes(self) -> int:
        return sum(
            t.buffer.numel() * t.buffer.element_size()
            for t in self.targets.values()
            if t.buffer is not None and not t.done
        )

    def add(self, piece: CanonicalSlice) -> None:
        target = self.targets.get(piece.name)
        if target is None or target.done:
            self.duplicate_bytes += piece.nbytes if target is not None else 0
            return
        if piece.dim is None:  # a whole tensor (replicated): take what the target needs
            whole = piece.tensor
            tensor = (
                whole
                if target.dim is None
                else whole.narrow(target.dim, target.start, target.stop - target.start)
            )
            self._finish(target, tensor)
            return
        dim = piece.dim
        lo, hi = (
            (target.start, target.stop) if target.dim is not None else (0, target.full_shape[dim])
        )
        if target.dim is not None and target.dim != dim:
            raise ValueError(f"{piece.name}: piece split on dim {dim}, target on {target.dim}")
        a, b = max(lo, piece.start), min(hi, piece.stop)
        if a >= b:
            return  # outside this rank's slice (the naive plan gathers such pieces)
        if a == lo and b == hi and piece.start == lo and piece.stop == hi:
            self._finish(target, piece.tensor)
            return
        if target.buffer is None:
            shape = list(target.full_shape)
            shape[dim] = hi - lo
            target.buffer = piece.tensor.new_empty(shape)
        target.buffer.narrow(dim, a - lo, b - a).copy_(
            piece.tensor.narrow(dim, a - piece.start, b - a)
        )
        target.covered += b - a
        if target.covered == hi - lo:
            self._finish(target, target.buffer)

    def _finish(self, target: _Target, tensor: torch.Tensor) -> None:
        target.done, target.buffer = True, None
        self.ready.append(
            CanonicalSlice(target.name, tensor, target.dim, target.start, target.full_shape)
        )

    def pop_ready(self) -> list[CanonicalSlice]:
        ready, self.ready = self.ready, []
        return ready

    def missing(self) -> list[str]:
        return sorted(n for n, t in self.targets.items() if not t.done)


def generation_targets(
    dims: ModelDims,
    rank_plan: RankPlan,
    gen: GenerationLayout,
    padded_vocab: int,
    experts: bool = True,
) -> dict[str, _Target]:
    """Canonical tensors (or TP slices) of this rank's generation shard (without the
    experts' when ``experts`` is False: they move separately under expert parallelism)."""
    stage = RankPosition(0, 1, rank_plan.gen_pp_rank, gen.pp)
    shapes = dims.canonical_shapes()
    names = {
        part.hf_name
        for param in rank_params(dims, stage, padded_vocab, experts=experts)
        for part in param.parts
    }
    targets = {}
    for name in sorted(names):
        dim, start, stop = tp_slice_range(dims, name, rank_plan.gen_tp_rank, gen.tp, padded_vocab)
        targets[name] = _Target(name, dim, start, stop, shapes[name])
    return targets


@dataclass
class _Unit:
    """One member's training unit: its parameters laid end to end."""

    unit: Unit
    params: list[NativeParam]
    offsets: list[int]
    numel: int
    needed: bool
    next: int = 0
    partial: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        dims: ModelDims,
        pos: RankPosition,
        padded_vocab: int,
        needed: bool,
        experts: bool = True,
    ) -> _Unit:
        params = rank_params(dims, pos, padded_vocab, experts=experts)
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel
        return cls((pos.pp_rank, pos.tp_rank), params, offsets, total, needed)

    def feed(self, data: torch.Tensor, lo: int, hi: int) -> list[tuple[NativeParam, torch.Tensor]]:
        """Parameters completed by this member's elements ``[lo, hi)`` (``data``)."""
        done = []
        while self.next < len(self.params):
            param, start = self.params[self.next], self.offsets[self.next]
            end = start + param.numel
            if start >= hi:
                break
            if start >= lo and end <= hi:
                done.append((param, data[start - lo : end - lo].view(param.shape)))
                self.next += 1
                continue
            if self.partial is None:
                self.partial = data.new_empty(param.numel)
            a, b = max(start, lo), min(end, hi)
            self.partial[a - start : b - start].copy_(data[a - lo : b - lo])
            if end > hi:
                break
            done.append((param, self.partial.view(param.shape)))
            self.partial = None
            self.next += 1
        return done


class Resharder:
    """One transition of one rank: call :meth:`stream` on every rank together."""

    def __init__(
        self,
        *,
        params: Mapping[str, torch.Tensor],
        dims: ModelDims,
        plan: ReshardPlan,
        rank: int,
        padded_vocab: int,
        export_dtype: torch.dtype | None = None,
        experts: bool = True,
    ) -> None:
        """``experts=False``: the training units leave the experts out (expert parallelism:
        :class:`ExpertGather` moves them)."""
        self.plan, self.rank, self.dims = plan, rank, dims
        self.rank_plan = rp = plan.for_rank(rank)
        self.padded_vocab = padded_vocab
        self.export_dtype = export_dtype
        train = plan.train
        self.group = gather_group(plan, rank)
        self.members = list(rp.gather_group)
        self.my_index = self.members.index(rank)
        gen_units = rp.gen_shard.units()
        self.units = []
        for member in self.members:
            c = train.coords(member)
            pos = RankPosition(c.tp, train.tp, c.pp, train.pp)
            needed = (c.pp, c.tp) in gen_units
            self.units.append(_Unit.of(dims, pos, padded_vocab, needed, experts))
        own = self.units[self.my_index]
        missing = [p.name for p in own.params if p.name not in params]
        if missing:
            raise KeyError(f"rank {rank} lacks parameters {missing[:4]} of its training unit")
        self.own_tensors = [params[p.name] for p in own.params]
        self._own_storages = {t.untyped_storage().data_ptr() for t in self.own_tensors}
        dtypes = {t.dtype for t in self.own_tensors}
        if len(dtypes) != 1:
            raise TypeError(f"a training unit must have one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.device = self.own_tensors[0].device  # nccl gathers need device buffers
        all_units = [
            _Unit.of(dims, RankPosition(tp, train.tp, pp, train.pp), padded_vocab, False, experts)
            for pp in range(train.pp)
            for tp in range(train.tp)
        ]
        self.unit_numel = max(u.numel for u in all_units)
        self.stats = ReshardStats(
            kind=plan.kind,
            rank=rank,
            gather_group=rp.gather_group,
            element_size=torch.empty((), dtype=self.dtype).element_size(),
            unit_numel=self.unit_numel,
            model_numel=self.unit_numel * train.model_parallel_size,
            real_model_numel=sum(u.numel for u in all_units),
            own_unit=own.unit,
            gen_units=set(gen_units),
        )
        self.assembler = SliceAssembler(
            generation_targets(dims, rp, plan.gen, padded_vocab, experts), self.dtype
        )

    # ---------------------------------------------------------------------------- run
    def _fill_send_slot(self, slot: torch.Tensor, lo: int, hi: int) -> None:
        own = self.units[self.my_index]
        if hi > own.numel:  # padding up to the largest unit
            slot.zero_()
        for param, start, tensor in zip(own.params, own.offsets, self.own_tensors, strict=True):
            end = start + param.numel
            a, b = max(start, lo), min(end, hi)
            if a < b:
                slot[a - lo : b - lo].copy_(tensor.detach().reshape(-1)[a - start : b - start])

    def _own_completed(self, hi: int) -> list[tuple[NativeParam, torch.Tensor]]:
        """Own parameters whose elements all lie below ``hi``: used in place, no copy."""
        own = self.units[self.my_index]
        done = []
        while (
            own.next < len(own.params) and own.offsets[own.next] + own.params[own.next].numel <= hi
        ):
            done.append((own.params[own.next], self.own_tensors[own.next].detach()))
            own.next += 1
        return done

    def _emit(self) -> list[CanonicalSlice]:
        ready = self.assembler.pop_ready()
        if self.export_dtype is not None:
            ready = [
                CanonicalSlice(s.name, s.tensor.to(self.export_dtype), s.dim, s.start, s.full_shape)
                for s in ready
            ]
        self.stats.emitted_tensors += len(ready)
        self.stats.emitted_bytes += sum(s.nbytes for s in ready)
        return ready

    @torch.no_grad()
    def stream(self, bucket_bytes: int) -> Iterator[list[CanonicalSlice]]:
        """Run the transition; yield the generation shard's tensors bucket by bucket.

        Every rank of the training group must consume its stream to the end (collectives).
        ``bucket_bytes`` bounds one all-gather's output (``group size x chunk``).
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        stats, size = self.stats, len(self.members)
        chunk = max(1, int(bucket_bytes) // (size * stats.element_size))
        full_shapes = self.dims.canonical_shapes()
        start_time, wchar0 = time.perf_counter(), _wchar()
        for lo in range(0, self.unit_numel, chunk):
            hi = min(self.unit_numel, lo + chunk)
            width = hi - lo
            out = torch.empty(size * width, dtype=self.dtype, device=self.device)
            slot = out[self.my_index * width : (self.my_index + 1) * width]
            self._fill_send_slot(slot, lo, hi)
            if size > 1:
                _all_gather_single(out, slot, self.group)
                stats.collectives += 1
            stats.sent_bytes += width * stats.element_size
            completed: list[tuple[NativeParam, torch.Tensor]] = []
            for index, unit in enumerate(self.units):
                if index == self.my_index:
                    completed += self._own_completed(hi)
                    continue
                stats.received_bytes += width * stats.element_size
                stats.received_units.add(unit.unit)
                if unit.needed:
                    completed += unit.feed(out[index * width : (index + 1) * width], lo, hi)
            for param, tensor in completed:
                for piece in param.split(tensor, full_shapes, include_tied=True):
                    self.assembler.add(piece)
            partial = sum(
                u.partial.numel() * u.partial.element_size()
                for u in self.units
                if u.partial is not None
            )
            ready = self._emit()
            copies = 0
            for piece in ready:
                storage = piece.tensor.untyped_storage().data_ptr()
                if storage in self._own_storages:
                    stats.reused_bytes += piece.nbytes
                elif storage != out.untyped_storage().data_ptr():
                    copies += piece.nbytes
            live = out.numel() * out.element_size() + partial + self.assembler.buffer_bytes
            stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, live + copies)
            del completed, out, slot
            if ready:
                yield ready
        stats.seconds = time.perf_counter() - start_time
        stats.wire_bytes_written = _wchar() - wchar0 if wchar0 >= 0 else -1
        missing = self.assembler.missing()
        if missing:
            raise RuntimeError(f"rank {self.rank}: reshard left {missing[:5]} incomplete")


class ExpertGather:
    """The experts' phase of a transition under expert parallelism (module docstring).

    Supported training layouts: ``pp = 1``, any ``tp``: one all-gather per layer over the
    expert tensor-and-expert-parallel group (its ``tp * ep`` ranks together hold every expert
    of the layer once: each its own experts' TP slice), assembled into the generation shard's
    whole experts or generation TP slices.  ``pp > 1`` is refused by name.  Every rank of the
    group must consume :meth:`stream` together.  Counts go into ``stats`` (``expert_*_bytes``).
    """

    def __init__(
        self,
        *,
        params: Mapping[str, torch.Tensor],
        dims: ModelDims,
        train: ParallelLayout,
        rank: int,
        ep: int,
        rank_plan: RankPlan,
        gen: GenerationLayout,
        padded_vocab: int,
        group: dist.ProcessGroup,
        stats: ReshardStats,
        export_dtype: torch.dtype | None = None,
    ) -> None:
        if train.pp != 1:
            raise NotImplementedError(
                f"exporting experts under expert parallelism (ep={ep}) needs pp=1 in "
                f"training, got pp={train.pp}"
            )
        self.params, self.dims = params, dims
        self.rank_plan, self.gen, self.padded_vocab = rank_plan, gen, padded_vocab
        self.group, self.stats, self.export_dtype = group, stats, export_dtype
        ranks = dist.get_process_group_ranks(group)
        self.my_index = ranks.index(rank)

        def position(r: int) -> RankPosition:
            c = train.coords(r)
            return RankPosition(c.tp, train.tp, 0, 1, c.dp % ep, ep)

        self.members = [position(r) for r in ranks]
        held = sorted((m.tp_rank, m.ep_rank) for m in self.members)
        if held != sorted((t, e) for t in range(train.tp) for e in range(ep)):
            raise RuntimeError(f"the expert group {ranks} does not hold every expert slice once")
        self.gen_layers = _stage_layers(dims, rank_plan.gen_pp_rank, gen.pp)

    def _layer_params(self, pos: RankPosition, layer: int) -> list[NativeParam]:
        prefix = f"decoder.layers.{layer}.mlp.experts."
        return [
            p for p in rank_params(self.dims, pos, self.padded_vocab) if p.name.startswith(prefix)
        ]

    def _targets(self, layer: int) -> dict[str, _Target]:
        shapes = self.dims.canonical_shapes()
        targets = {}
        for expert in range(self.dims.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
                dim, start, stop = tp_slice_range(
                    self.dims, name, self.rank_plan.gen_tp_rank, self.gen.tp, self.padded_vocab
                )
                targets[name] = _Target(name, dim, start, stop, shapes[name])
        return targets

    @torch.no_grad()
    def stream(self) -> Iterator[list[CanonicalSlice]]:
        """Per MoE layer, one all-gather of the experts; the generation shard's pieces."""
        stats, full_shapes = self.stats, self.dims.canonical_shapes()
        me, size = self.my_index, len(self.members)
        for layer in range(self.dims.num_layers):
            own = self._layer_params(self.members[me], layer)
            flat = torch.cat([self.params[p.name].detach().reshape(-1) for p in own])
            width = flat.numel()
            out = flat.new_empty(width * size)
            out[me * width : (me + 1) * width].copy_(flat)
            if size > 1:
                _all_gather_single(out, out[me * width : (me + 1) * width], self.group)
                stats.collectives += 1
            stats.expert_sent_bytes += width * flat.element_size()
            stats.expert_received_bytes += (size - 1) * width * flat.element_size()
            if layer not in self.gen_layers:
                continue
            assembler = SliceAssembler(self._targets(layer), flat.dtype)
            for index, member in enumerate(self.members):
                data, offset = out[index * width : (index + 1) * width], 0
                for param in self._layer_params(member, layer):
                    tensor = data[offset : offset + param.numel].view(param.shape)
                    offset += param.numel
                    for piece in param.split(tensor, full_shapes):
                        assembler.add(piece)
            missing = assembler.missing()
            if missing:
                raise RuntimeError(f"the experts' phase left {missing[:4]} incomplete")
            bucket = [self._owned(piece) for piece in assembler.pop_ready()]
            stats.emitted_tensors += len(bucket)
            stats.emitted_bytes += sum(s.nbytes for s in bucket)
            yield bucket

    def _owned(self, piece: CanonicalSlice) -> CanonicalSlice:
        """A piece off the gather buffer, in the export dtype."""
        tensor = piece.tensor.clone()
        if self.export_dtype is not None:
            tensor = tensor.to(self.export_dtype)
        return CanonicalSlice(piece.name, tensor, piece.dim, piece.start, piece.full_shape)


def expert_bytes_per_rank(
    dims: ModelDims, ep: int, element_size: int, tp: int = 1
) -> tuple[int, int]:
    """The plan's figure for the experts' phase of a transition (``pp = 1``): bytes each
    rank sends (its own experts' TP slice, once per layer's all-gather) and receives (every
    other rank's of the ``tp * ep`` group, once: ``(tp ep - 1) / (tp ep)`` of the model's
    expert bytes; nothing is received twice)."""
    per_expert = 3 * dims.moe_ffn_size * dims.hidden_size  # gate, up and down
    model = dims.num_layers * dims.num_experts * per_expert * element_size
    ranks = tp * ep
    return model // ranks, model * (ranks - 1) // ranks


def _stage_layers(dims: ModelDims, stage: int, stages: int) -> range:
    per_stage = dims.num_layers // stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """In-place all-gather (``inp`` is this rank's slot of ``out``)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)
