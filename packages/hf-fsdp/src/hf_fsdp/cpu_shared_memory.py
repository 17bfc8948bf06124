"""FSDP2's all-gather and reduce-scatter through shared memory, for CPU ranks on one host.

Why: on CPU, FSDP2's collectives go through gloo, which moves tensors over loopback TCP far
below memory speed, so two ranks spent much of a large update in collectives and ran slower than
one rank on the same cores.  Ranks that share a host can instead copy through one file in
``/dev/shm`` at memory speed (docs/performance.md, "Measured choices").  FSDP2 exposes exactly
this hook (``set_custom_all_gather`` / ``set_custom_reduce_scatter``; its NCCL counterpart is
symmetric memory).

How: each rank owns a slot of the shared file.  A collective copies this rank's part into its
slot, waits on a gloo barrier, then reads the other ranks' slots.  Large tensors go through in
slot-sized pieces.  Slots alternate between two sets from one call to the next, so one barrier
per piece is enough: a rank can only overwrite a slot set after every peer passed the next
barrier, i.e. finished reading it.  The barrier stays on gloo so that a dead peer fails the
call (and the worker reports it) instead of leaving the others spinning.

The file holds one rank's largest unit shard per slot (:func:`exchange_file_bytes`, capped
at 32 MiB): every rank maps the whole file and its pages count in each rank's resident memory,
so the file is kept small; a larger tensor costs one more gloo barrier per slot-sized piece.

Only used on CPU, when every rank of the group can map the same file (checked with a token
at set-up; otherwise FSDP keeps gloo).  The file is unlinked as soon as every rank has mapped
it, so nothing is left behind when a run dies.  GPUs keep NCCL: see :func:`attach`.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from hf_fsdp.config import SHARED_MEMORY_FILE_BYTES

log = logging.getLogger(__name__)

SHARED_FOLDER = "/dev/shm"
_ALIGN = 4096
_TOKEN_BYTES = 16


class SharedMemoryExchange:
    """One shared file mapped by every rank of ``group`` on this host, with two slot sets
    of one slot per rank; the call counter picks the set (all ranks call in the same order,
    as collectives must)."""

    def __init__(self, group: dist.ProcessGroup, buffer: torch.Tensor, slot_bytes: int) -> None:
        self.group = group
        self.rank = group.rank()
        self.world = group.size()
        self.buffer = buffer
        self.slot_bytes = slot_bytes
        self.calls = 0

    def next_slots(self) -> list[torch.Tensor]:
        """Every rank's slot (uint8) of the set this call uses."""
        parity = self.calls % 2
        self.calls += 1
        base = parity * self.world * self.slot_bytes
        return [
            self.buffer[base + r * self.slot_bytes : base + (r + 1) * self.slot_bytes]
            for r in range(self.world)
        ]

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class _PlainBuffers:
    """FSDP's buffers in ordinary memory: only the slots live in the shared file."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class SharedMemoryAllGather(_PlainBuffers, AllGather):
    """``all_gather_into_tensor`` over the shared file (FSDP2 ``AllGather``)."""

    def __init__(self, exchange: SharedMemoryExchange) -> None:
        self.exchange = exchange

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        ex = self.exchange
        source = _bytes(input_tensor)
        target = _bytes(output_tensor)
        count = source.numel()
        if target.numel() != count * ex.world:
            raise ValueError(
                f"all-gather output holds {target.numel()} bytes, expected {ex.world} x {count}"
            )
        mine = target[ex.rank * count : (ex.rank + 1) * count]
        if mine.data_ptr() != source.data_ptr():  # FSDP's copy-in already put it there
            mine.copy_(source)
        for start in range(0, count, ex.slot_bytes):
            stop = min(start + ex.slot_bytes, count)
            slots = ex.next_slots()
            slots[ex.rank][: stop - start].copy_(source[start:stop])
            ex.barrier()
            for peer in range(ex.world):
                if peer != ex.rank:
                    offset = peer * count
                    target[offset + start : offset + stop].copy_(slots[peer][: stop - start])
        return None


class SharedMemoryReduceScatter(_PlainBuffers, ReduceScatter):
    """``reduce_scatter_tensor`` (sum or average) over the shared file (FSDP2
    ``ReduceScatter``); other reduce ops go to the process group."""

    def __init__(self, exchange: SharedMemoryExchange) -> None:
        self.exchange = exchange

    def __call__(  # type: ignore[override]
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        ex = self.exchange
        average = op == dist.ReduceOp.AVG
        if not (average or op == dist.ReduceOp.SUM):
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        source = input_tensor.reshape(-1)
        target = output_tensor.reshape(-1)
        chunk = target.numel()
        if source.numel() != chunk * ex.world:
            raise ValueError(
                f"reduce-scatter input holds {source.numel()} elements, expected "
                f"{ex.world} x {chunk}"
            )
        others = [r for r in range(ex.world) if r != ex.rank]
        # a slot carries one piece of every peer's chunk
        piece = max(1, ex.slot_bytes // (source.element_size() * len(others)))
        for start in range(0, chunk, piece):
            stop = min(start + piece, chunk)
            length = stop - start
            slots = [s.view(source.dtype) for s in ex.next_slots()]
            for index, peer in enumerate(others):
                offset = peer * chunk
                slots[ex.rank][index * length : (index + 1) * length].copy_(
                    source[offset + start : offset + stop]
                )
            ex.barrier()
            out = target[start:stop]
            out.copy_(source[ex.rank * chunk + start : ex.rank * chunk + stop])
            for peer in others:
                index = ex.rank if ex.rank < peer else ex.rank - 1  # my place in peer's list
                out.add_(slots[peer][index * length : (index + 1) * length])
        if average:
            target.div_(ex.world)
        return None


def map_shared_file(group: dist.ProcessGroup, size: int) -> torch.Tensor | None:
    """The same ``size``-byte file mapped on every rank, or ``None`` on all ranks when any
    rank cannot map it (another host, no ``/dev/shm``, too little room)."""
    rank = group.rank()
    path, token = "", b""
    if rank == 0:
        room = shutil.disk_usage(SHARED_FOLDER).free if os.path.isdir(SHARED_FOLDER) else 0
        if room >= 2 * size:
            token = secrets.token_bytes(_TOKEN_BYTES)
            path = os.path.join(SHARED_FOLDER, f"hybridflow-fsdp-{secrets.token_hex(8)}")
            with open(path, "wb") as handle:
                handle.write(token)
                handle.truncate(size)
    box: list[Any] = [(path, token)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    path, token = box[0]
    buffer: torch.Tensor | None = None
    if path:
        try:
            buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            if bytes(buffer[:_TOKEN_BYTES].tolist()) != token:
                buffer = None  # a different file of that name: another host
        except (OSError, RuntimeError):
            buffer = None
    if buffer is not None and rank == 0:
        # fault every page in now: the memory fit, measured at the first update, then sees
        # the file's pages as used instead of finding them taken during the first collectives
        buffer[_TOKEN_BYTES:].zero_()
    mapped: list[Any] = [None] * group.size()
    dist.all_gather_object(mapped, buffer is not None, group=group)
    if rank == 0 and path:
        os.unlink(path)  # every rank has it mapped (or gave up): nothing to clean up later
    return buffer if all(mapped) else None


_EXCHANGES: dict[int, tuple[dist.ProcessGroup, SharedMemoryExchange | None]] = {}


def _entry(
    group: dist.ProcessGroup,
) -> tuple[dist.ProcessGroup, SharedMemoryExchange | None] | None:
    """What this process set up for ``group``, if anything (ids of dead groups are reused,
    hence the identity check)."""
    entry = _EXCHANGES.get(id(group))
    return entry if entry is not None and entry[0] is group else None


def exchange_for(
    group: dist.ProcessGroup, file_bytes: int = SHARED_MEMORY_FILE_BYTES
) -> SharedMemoryExchange | None:
    """The group's exchange over a ``file_bytes`` file, set up once per process (engines on
    one group share it), or ``None`` when its ranks cannot share a file."""
    entry = _entry(group)
    if entry is not None:
        return entry[1]
    world = group.size()
    slot_bytes = file_bytes // (2 * world) // _ALIGN * _ALIGN
    buffer = map_shared_file(group, 2 * world * slot_bytes)
    exchange = None if buffer is None else SharedMemoryExchange(group, buffer, slot_bytes)
    if exchange is None:
        log.info("FSDP collectives stay on the process group: its ranks share no /dev/shm file")
    else:
        log.info(
            "FSDP collectives of %d ranks copy through shared memory (%d MiB)",
            world,
            (2 * world * slot_bytes) >> 20,
        )
    _EXCHANGES[id(group)] = (group, exchange)
    return exchange


def all_gather_into(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` = every rank's ``local`` in rank order: through the group's shared memory
    when its FSDP engine set it up (the weight export's buckets), else the process group."""
    entry = _entry(group)
    exchange = entry[1] if entry is not None else None
    if exchange is None or local.device.type != "cpu":
        dist.all_gather_into_tensor(output, local, group=group)
    else:
        SharedMemoryAllGather(exchange)(output, local, group)


def largest_unit_shard_bytes(model: torch.nn.Module, world: int) -> int:
    """The most bytes one rank contributes to one FSDP unit's collective: its shard of the
    unit's own parameters (dim 0 split over ``world``, padded as FSDP2 pads), at no less than
    4 bytes an element (gradients may be reduced in float32 under bf16 weights)."""
    largest = 0
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        nested = {
            id(param)
            for child in unit.modules()
            if child is not unit and isinstance(child, FSDPModule)
            for param in child.parameters()
        }
        own = [p for p in unit.parameters() if id(p) not in nested]
        largest = max(
            largest, sum(_shard_elements(p, world) * max(4, p.element_size()) for p in own)
        )
    return largest


def _shard_elements(param: torch.Tensor, world: int) -> int:
    """Elements of one rank's dim-0 shard of ``param``, padded to equal shares."""
    if param.dim() == 0 or param.shape[0] == 0:
        return param.numel()
    return -(-param.shape[0] // world) * (param.numel() // param.shape[0])


def exchange_file_bytes(model: torch.nn.Module, world: int) -> int:
    """The shared file FSDP's collectives for ``model`` need: two slot sets of one slot per
    rank, a slot taking a rank's largest shard whole (a reduce-scatter piece carries one part
    per peer), capped at :data:`SHARED_MEMORY_FILE_BYTES` (larger units go through in
    pieces).  A small model thus maps megabytes, not the cap, on every rank."""
    slot = largest_unit_shard_bytes(model, world) * max(1, world - 1)
    slot = -(-max(slot, _ALIGN) // _ALIGN) * _ALIGN
    return min(SHARED_MEMORY_FILE_BYTES, 2 * world * slot)


def attach(model: torch.nn.Module, group: dist.ProcessGroup) -> bool:
    """Route every FSDP unit of ``model`` through shared memory; ``False`` (and gloo kept)
    when ``group`` has one rank or its ranks cannot share a file.  CPU models only.  The
    file is sized to the model (:func:`exchange_file_bytes`) unless another engine of this
    process already set one up for ``group``, which is then shared."""
    if group.size() < 2:
        return False
    exchange = exchange_for(group, exchange_file_bytes(model, group.size()))
    if exchange is None:
        return False
    gather, scatter = SharedMemoryAllGather(exchange), SharedMemoryReduceScatter(exchange)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
    return True
