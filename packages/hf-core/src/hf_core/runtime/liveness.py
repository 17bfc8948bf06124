"""Liveness of a set of worker processes: waiting on their results without ever hanging.

:meth:`Liveness.wait` polls so that a failed rank is reported at once rather than after the
others, pings ranks that are still running so that a hung or vanished process is reported
after a bounded silence, lets a failed rank's peers settle (or marks the group broken when
they stay blocked in a collective), and reports a peer's death rather than the error it
caused on a survivor.  Before a lost rank is reported every rank appends its Python stacks
to its file in ``stacks_dir`` (:meth:`Liveness.dump_stacks`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from hf_core.runtime.errors import GroupBrokenError, WorkerError, WorkerLostError
from hf_core.worker import StaleMeshError

_POLL_S = 0.2


def kernel_oom_kills() -> int:
    """Processes the kernel's out-of-memory killer (or a memory cgroup's) has ended on this
    host since boot (``/proc/vmstat``); -1 where the counter cannot be read.  A worker that
    died while it rose is reported as out of memory (this host's workers: a single-node run,
    or the driver's node of a larger one)."""
    try:
        with open("/proc/vmstat") as stats:
            for line in stats:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


class Liveness:
    """Failure detection for the worker processes of one spawn (``actors[rank]``)."""

    def __init__(
        self,
        actors: list[Any],
        name: str,
        failure_timeout_s: float,
        stacks_dir: str,
        stack_files: list[str],
    ) -> None:
        self.actors, self.name = actors, name
        self.failure_timeout_s = failure_timeout_s
        self.heartbeat_s = min(5.0, failure_timeout_s / 3)
        self.broken: str | None = None
        """Why the group can run no further call (``None`` while it can)."""
        self.stacks_dir, self.stack_files = stacks_dir, stack_files

    def wait(
        self,
        refs: list[ray.ObjectRef],
        ranks: list[int],
        role: str,
        method: str,
        silence_s: float | None = None,
    ) -> list:
        """Results of ``refs`` (one per rank in ``ranks``); raise on the first failure.

        Polls so that a failed rank is reported at once rather than after the others, and
        pings ranks that are still running so that a hung or vanished process is reported
        after ``silence_s`` (default ``failure_timeout_s``) without a heartbeat.  A lost rank
        is reported with every rank's stacks dumped first (the error names the folder).
        """
        if self.broken:
            raise GroupBrokenError(f"worker group {self.name!r} is broken: {self.broken}")
        oom_kills = kernel_oom_kills()
        try:
            return self._wait(refs, ranks, role, method, silence_s)
        except WorkerLostError as exc:
            if exc.stacks_dir is not None:
                raise
            died = exc.reason.startswith("process died")
            out_of_memory = exc.out_of_memory or (died and kernel_oom_kills() > oom_kills)
            reason = exc.reason
            if out_of_memory and not exc.out_of_memory:
                reason = f"killed by the kernel's out-of-memory killer ({reason})"
            self.dump_stacks(f"rank {exc.rank} ({exc.role}) lost during {exc.method!r}", exc.rank)
            raise WorkerLostError(
                exc.role, exc.rank, exc.method, reason, self.stacks_dir, out_of_memory
            ) from None

    def _wait(
        self,
        refs: list[ray.ObjectRef],
        ranks: list[int],
        role: str,
        method: str,
        silence_s: float | None,
    ) -> list:
        silence_s = self.failure_timeout_s if silence_s is None else silence_s
        pending = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pings: dict[int, tuple[ray.ObjectRef, float]] = {}
        alive: dict[int, float] = {}
        started = time.monotonic()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    results[i] = self._get(ref, ranks[i], role, method)
                except (WorkerError, StaleMeshError):
                    peers = list(pending)
                    self._settle_peers(peers, ranks[i], role, method)
                    peer_ranks = [ranks[pending[r]] for r in peers]
                    self._raise_if_peer_died(peers, peer_ranks, role, method)
                    raise
            now = time.monotonic()
            # a call shorter than a heartbeat sends no ping (most calls of a small model);
            # past that, every poll checks, so a frozen rank is reported on time
            if pending and now - started >= self.heartbeat_s:
                running = {ranks[i] for i in pending.values()}
                self._check_pings(pings, alive, running, role, method, now, silence_s, started)
        return results

    def _settle_peers(
        self, pending: list[ray.ObjectRef], failed_rank: int, role: str, method: str
    ) -> None:
        """After one rank raised, give its peers ``failure_timeout_s`` to finish.

        In SPMD code the others may be blocked in a collective the failed rank never joins;
        then the group can never run another call, so it is marked broken (later calls raise
        :class:`GroupBrokenError` instead of queueing behind the stuck ranks).
        """
        if not pending:
            return
        _, stuck = ray.wait(pending, num_returns=len(pending), timeout=self.failure_timeout_s)
        if stuck:
            self.broken = (
                f"rank {failed_rank} ({role}) raised in {method!r} and {len(stuck)} other "
                f"rank(s) did not finish within {self.failure_timeout_s} s (blocked in a "
                f"collective?)"
            )

    def _raise_if_peer_died(
        self, peers: list[ray.ObjectRef], ranks: list[int], role: str, method: str
    ) -> None:
        """Report a peer's death rather than the error it caused on a survivor.

        A rank killed mid-collective makes the others' collective raise at once (gloo:
        "connection closed by peer"), often before Ray reports the death; the death is the
        cause, and it is what a restart can heal, so it wins.
        """
        done, _ = ray.wait(peers, num_returns=len(peers), timeout=0)
        for ref in done:
            rank = ranks[peers.index(ref)]
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                self.broken = f"rank {rank} ({role}) died during {method!r}"
                raise WorkerLostError(role, rank, method, f"process died: {exc}") from None
            except Exception:  # a peer's own error: the first one is reported
                continue

    def _get(self, ref: ray.ObjectRef, rank: int, role: str, method: str) -> Any:
        try:
            return ray.get(ref)
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, WorkerLostError):  # the worker process found its engine dead
                self.broken = f"rank {rank} ({role}) lost its engine during {method!r}"
                raise cause from None
            if isinstance(cause, (WorkerError, StaleMeshError)):
                raise cause from None
            raise WorkerError(
                role, rank, method, type(cause).__name__, str(cause), str(exc)
            ) from None
        except RayActorError as exc:
            self.broken = f"rank {rank} ({role}) died during {method!r}"
            raise WorkerLostError(role, rank, method, f"process died: {exc}") from None

    def _check_pings(
        self,
        pings: dict[int, tuple[ray.ObjectRef, float]],
        alive: dict[int, float],
        running: set[int],
        role: str,
        method: str,
        now: float,
        silence_s: float,
        started: float,
    ) -> None:
        """Ping each running rank once per heartbeat, and check every poll.  ``alive[rank]``
        is the last moment the rank is known to have been alive (when it was sent a ping it
        answered), so a frozen rank is reported ``silence_s`` after its last sign of life,
        not after the first ping it failed to answer (which can be a heartbeat later)."""
        for rank in running:
            if rank not in pings:
                pings[rank] = (self.actors[rank].ping.remote(), now)
                alive[rank] = started  # silence counts from the call's start until it answers
                continue
            ref, sent = pings[rank]
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    ray.get(ref, timeout=0)
                except (RayActorError, GetTimeoutError) as exc:
                    self.broken = f"rank {rank} ({role}) lost during {method!r}"
                    raise WorkerLostError(role, rank, method, f"process died: {exc}") from None
                alive[rank] = sent
                if now - sent >= self.heartbeat_s:
                    pings[rank] = (self.actors[rank].ping.remote(), now)
            elif now - alive[rank] > silence_s:
                self.broken = f"rank {rank} ({role}) stopped answering during {method!r}"
                raise WorkerLostError(
                    role,
                    rank,
                    method,
                    f"no sign of life for {now - alive[rank]:.1f} s (bound {silence_s} s)",
                )

    def dump_stacks(self, reason: str, lost: int | None = None) -> str:
        """Have every live rank append its Python stacks to its file in ``stacks_dir``.

        Bounded: a dead rank answers with an error at once, a frozen one not at all (its own
        watchdog dumped it already); neither delays the report by more than a few seconds.
        The ``lost`` rank is not asked: it cannot answer, and waiting for it would only
        delay the report.
        """
        refs = []
        for rank, actor in enumerate(self.actors):
            if rank == lost:
                continue
            try:
                refs.append(actor.dump_stacks.remote(reason))
            except Exception:  # an actor handle already gone
                continue
        timeout = min(3.0, self.failure_timeout_s / 2)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # a dead rank has no stacks to give
                continue
        return self.stacks_dir

    def remove_empty_stack_files(self) -> None:
        """A healthy run leaves no stacks files behind (the watchdog opens its file early)."""
        for path in self.stack_files:
            try:
                if os.path.getsize(path) == 0:
                    os.remove(path)
            except OSError:
                continue  # never written, or on another node's disk
        try:
            os.rmdir(self.stacks_dir)  # only if empty
        except OSError:
            pass
