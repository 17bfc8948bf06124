"""WorkerGroup: the controller's handle on one role's ranks.

``spawn(pool, {"actor": Actor, "ref": Reference})`` starts one :class:`WorkerProcess` per bundle
of the pool, sets up torch.distributed across them (gloo on CPU, nccl on GPU) and returns one
:class:`WorkerGroup` per role.  Roles spawned together share processes (colocation); roles
spawned on different pools are split.

Every ``@register``-ed worker method becomes a method of the group.  A call dispatches its
arguments with the method's transfer protocol and returns the collected result, or a
:class:`GroupFuture` for non-blocking methods (and for ``group.method.remote(...)``).  A future
passed as an argument to another group's method travels as Ray object references straight from
the producing ranks to the consuming ones when the protocols agree on the chunking.

Failures never hang the controller: an exception on any rank becomes a
:class:`~hf_core.runtime.errors.WorkerError` with role, rank, method and remote traceback; a
dead or unresponsive process becomes a :class:`~hf_core.runtime.errors.WorkerLostError` within
``failure_timeout_s``.  Before raising it the controller has every rank append its Python
stacks to a file in ``stacks_dir`` (a rank frozen with the GIL held dumps its own, from a
watchdog: see :class:`~hf_core.runtime.worker_process.StackWatchdog`); the error names the folder.
Starting the processes lives in :mod:`hf_core.runtime.process_set`, failure detection in
:mod:`hf_core.runtime.liveness`; this module dispatches and collects.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import ray

from hf_core.batch import Batch
from hf_core.plugins import get_protocol
from hf_core.protocols.decorator import MethodSpec, registered_methods
from hf_core.protocols.mesh import WorkerMesh
from hf_core.protocols.transfer import GroupContext, TransferProtocol
from hf_core.runtime.pool import ResourcePool
from hf_core.runtime.process_set import ProcessSet
from hf_core.runtime.worker_process import RoleSpec
from hf_core.worker import StaleMeshError, Worker


class GroupFuture:
    """The pending result of one group call; ``result()`` collects it."""

    def __init__(
        self,
        group: WorkerGroup,
        method: str,
        protocol: TransferProtocol,
        ctx: GroupContext,
        refs: dict[int, ray.ObjectRef],
        pad: int,
        padded_len: int,
        upstream: list[GroupFuture],
        redispatch: Callable[[], GroupFuture] | None,
    ) -> None:
        self.group, self.method, self.protocol, self.ctx = group, method, protocol, ctx
        self.refs = refs
        self.pad, self.padded_len = pad, padded_len
        self.upstream = upstream
        self._redispatch = redispatch
        self.resolved = False
        """True once the driver fetched the outputs (a pass-through never does)."""
        self._value: Any = None

    def chunk_refs(self, chunks: int, chunked_target: bool) -> list[ray.ObjectRef] | None:
        """Per-chunk object refs if the output can go to a consumer without the driver."""
        if self.pad or self.resolved:
            return None
        refs = [self.refs[rank] for rank in self.protocol.collect_ranks(self.ctx)]
        if self.protocol.chunked and chunked_target and len(refs) == chunks:
            return refs
        if self.protocol.single_output and chunks == 1:
            return refs
        return None

    def result(self) -> Any:
        """Wait for every rank, raise the first failure, return the combined output."""
        if self.resolved:
            return self._value
        try:
            for future in self.upstream:  # producer failures on ranks we did not read
                future.wait()
            by_rank = self._wait()
        except StaleMeshError:
            if self._redispatch is None:
                raise
            # Every rank refused before running anything: refresh our view and call again.
            for future in self.upstream:
                future.result()
            self.group.meshes(refresh=True)
            self._value = self._redispatch().result()
            self.resolved = True
            return self._value
        value = self.protocol.combine([by_rank[r] for r in self.protocol.collect_ranks(self.ctx)])
        if self.pad and isinstance(value, Batch):
            value = _unpad_output(value, self.pad, self.padded_len)
        self._value, self.resolved = value, True
        return value

    def _wait(self) -> dict[int, Any]:
        ranks = sorted(self.refs)
        outputs = self.group.processes.wait(
            [self.refs[r] for r in ranks], ranks, self.group.role, self.method
        )
        return dict(zip(ranks, outputs, strict=True))

    def done(self) -> bool:
        """Whether every rank has finished (successfully or not), without blocking."""
        if self.resolved:
            return True
        refs = list(self.refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def wait(self) -> None:
        """Block until every rank finished (raising its error), without combining outputs."""
        if not self.resolved:
            self._wait()


def _unpad_output(value: Batch, pad: int, padded_len: int) -> Batch:
    """Drop outputs of padding samples; outputs may be a multiple of the inputs (n samples)."""
    if len(value) % padded_len:
        raise ValueError(
            f"cannot remove padding: output of {len(value)} rows is not a multiple of the "
            f"{padded_len} padded input rows"
        )
    return value.unpad(pad * (len(value) // padded_len))


class BoundMethod:
    """``group.method(...)``: call with the method's protocol; ``.remote(...)`` for a future."""

    def __init__(self, group: WorkerGroup, name: str, spec: MethodSpec) -> None:
        self.group, self.name, self.spec = group, name, spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        future = self.remote(*args, **kwargs)
        return future.result() if self.spec.blocking else future

    def remote(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self.group.dispatch(self.name, self.spec, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self.group.role}.{self.name} via {self.spec.protocol_name}>"


class WorkerGroup:
    """One role's ranks, as the controller sees them."""

    if TYPE_CHECKING:
        # Each @register-ed method of the worker class becomes a BoundMethod attribute.
        def __getattr__(self, name: str) -> BoundMethod: ...

    def __init__(self, processes: ProcessSet, role: str, cls: type[Worker]) -> None:
        self.processes, self.role, self.worker_cls = processes, role, cls
        self._meshes: tuple[tuple[int, WorkerMesh], ...] | None = None
        for name, spec in registered_methods(cls).items():
            if hasattr(type(self), name):
                raise TypeError(f"{cls.__name__}.{name} clashes with a WorkerGroup attribute")
            setattr(self, name, BoundMethod(self, name, spec))

    @property
    def world_size(self) -> int:
        return self.processes.world_size

    @property
    def pids(self) -> list[int]:
        return list(self.processes.pids)

    def meshes(self, refresh: bool = False) -> tuple[WorkerMesh, ...]:
        """Every rank's mesh, as the workers last reported it."""
        if self._meshes is None or refresh:
            ranks = list(range(self.world_size))
            refs = [a.mesh.remote(self.role) for a in self.processes.actors]
            self._meshes = tuple(self.processes.wait(refs, ranks, self.role, "mesh"))
        return tuple(mesh for _, mesh in self._meshes)

    def dispatch(self, method: str, spec: MethodSpec, args: tuple, kwargs: dict) -> GroupFuture:
        protocol = (
            spec.protocol
            if isinstance(spec.protocol, TransferProtocol)
            else get_protocol(spec.protocol)
        )
        return self._dispatch(method, spec, protocol, args, kwargs, retry=protocol.needs_mesh)

    def _dispatch(
        self,
        method: str,
        spec: MethodSpec,
        protocol: TransferProtocol,
        args: tuple,
        kwargs: dict,
        retry: bool,
    ) -> GroupFuture:
        meshes = self.meshes() if protocol.needs_mesh else None
        ctx = GroupContext(self.world_size, meshes)
        owner = protocol.chunk_owner(ctx)
        chunks = max(owner) + 1
        rank_zero = spec.execute == "rank_zero" or (
            spec.execute is None and protocol.rank_zero_only
        )
        ranks = [0] if rank_zero else list(range(self.world_size))

        upstream: list[GroupFuture] = []
        pads: set[int] = set()
        padded_lens: set[int] = set()
        readers = Counter(owner[rank] for rank in ranks)

        def per_chunk(value: Any) -> list[Any]:
            if isinstance(value, GroupFuture):
                refs = value.chunk_refs(chunks, protocol.chunked)
                if refs is not None:
                    upstream.append(value)
                    return refs
                value = value.result()
            if isinstance(value, Batch) and protocol.pad_batches:
                value, pad = value.pad_to_multiple(chunks)
                pads.add(pad)
                padded_lens.add(len(value))
            pieces = protocol.split(value, chunks)
            # a Batch chunk several ranks read goes to the object store once; one read by a
            # single rank travels inline with its call (Ray stores a large one by itself):
            # a put plus the worker's fetch costs a small step's call more than sending it inline
            return [
                ray.put(p) if isinstance(p, Batch) and readers[c] > 1 else p
                for c, p in enumerate(pieces)
            ]

        arg_chunks = [per_chunk(a) for a in args]
        kwarg_chunks = {k: per_chunk(v) for k, v in kwargs.items()}
        if len(pads) > 1 or len(padded_lens) > 1:
            raise ValueError(f"{self.role}.{method}: batch arguments have different sizes")
        versions = [v for v, _ in self._meshes] if protocol.needs_mesh and self._meshes else None
        refs = {}
        for rank in ranks:
            c = owner[rank]
            refs[rank] = self.processes.actors[rank].execute.remote(
                self.role,
                method,
                versions[rank] if versions else None,
                *[a[c] for a in arg_chunks],
                **{k: v[c] for k, v in kwarg_chunks.items()},
            )
        pad = pads.pop() if pads else 0
        padded_len = padded_lens.pop() if padded_lens else 0

        def redispatch() -> GroupFuture:
            return self._dispatch(method, spec, protocol, args, kwargs, retry=False)

        return GroupFuture(
            self,
            method,
            protocol,
            ctx,
            refs,
            pad,
            padded_len,
            upstream,
            redispatch if retry else None,
        )

    def shutdown(self) -> None:
        """Kill this group's processes (and those of roles colocated with it)."""
        self.processes.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup(role={self.role!r}, world_size={self.world_size})"


def spawn(
    pool: ResourcePool,
    roles: Mapping[str, type[Worker] | RoleSpec],
    *,
    name: str | None = None,
    dist_backend: str | None = "auto",
    env: Mapping[str, str] | None = None,
    failure_timeout_s: float = 30.0,
    startup_timeout_s: float = 300.0,
    stacks_dir: str | None = None,
) -> dict[str, WorkerGroup]:
    """Start one process per bundle running every role given; one group per role.

    ``dist_backend``: ``"auto"`` (gloo on CPU pools, nccl on GPU pools), an explicit backend,
    or ``None`` to skip torch.distributed.  ``failure_timeout_s`` bounds how long a running
    call may go without a heartbeat; ``startup_timeout_s`` does so while processes start.
    ``stacks_dir``: where every rank's Python stacks go when a rank is lost (default:
    ``<tmp>/hybridflow-stacks``).
    """
    if not roles:
        raise ValueError("spawn needs at least one role")
    specs = {r: s if isinstance(s, RoleSpec) else RoleSpec(s) for r, s in roles.items()}
    for role, spec in specs.items():
        if not (isinstance(spec.cls, type) and issubclass(spec.cls, Worker)):
            raise TypeError(f"role {role!r}: {spec.cls!r} is not a Worker subclass")
    processes = ProcessSet(
        pool,
        specs,
        name=name or "_".join(specs),
        dist_backend=dist_backend,
        env=env,
        failure_timeout_s=failure_timeout_s,
        startup_timeout_s=startup_timeout_s,
        stacks_dir=stacks_dir,
    )
    return {role: WorkerGroup(processes, role, spec.cls) for role, spec in specs.items()}
