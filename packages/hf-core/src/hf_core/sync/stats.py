"""Numbers of a rollout engine's weight sync, as the trainer logs them.

The receiving end of every sync in this package is a rollout engine's ``load_weights`` /
``finish_weight_sync``; what it measured comes back through ``sync_metrics()``.  A rollout
engine that loads weights in buckets records one :class:`SyncStats` per sync (a
subclass adds what only that backend measures) and gets ``last_sync``,
``last_sync_seconds`` and :meth:`~hf_core.engines.RolloutEngine.sync_metrics` from
:class:`RecordsSyncs`, so every backend reports the same ``weight_sync/`` keys.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from hf_core.engines import NamedTensor, tensor_nbytes, worst_rank


@dataclass
class SyncStats:
    """One weight sync (``seconds`` is the headline number).

    Every ``int`` / ``float`` field becomes a metric; other fields (a transport's name) are
    for logs and tests only.
    """

    seconds: float = 0.0
    """Wall time from the first bucket to the end of ``finish_weight_sync`` (includes the
    training engine's gathers between buckets)."""
    engine_seconds: float = 0.0
    """Time spent inside the rollout engine's own calls."""
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.perf_counter, repr=False)

    def add(self, bucket: Sequence[NamedTensor]) -> None:
        """Count one bucket of canonical tensors."""
        self.buckets += 1
        self.tensors += len(bucket)
        self.bytes += sum(tensor_nbytes(t) for _, t in bucket)

    def finish(self) -> None:
        """Stop the clock: ``seconds`` is the time since :attr:`started`."""
        self.seconds = time.perf_counter() - self.started

    def as_metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        values = asdict(self)
        values.pop("started")
        return {
            prefix + key: float(value)
            for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }


class RecordsSyncs:
    """Mixin for a rollout engine that keeps its last sync's :class:`SyncStats` in
    ``last_sync``: the trainer reads them through ``sync_metrics()``."""

    last_sync: SyncStats | None = None

    @property
    def last_sync_seconds(self) -> float | None:
        """Seconds the last completed sync took (first bucket to cache flush)."""
        return self.last_sync.seconds if self.last_sync else None

    def sync_metrics(self) -> dict[str, float]:
        """The last sync's numbers under ``weight_sync/`` keys, for the trainer's log."""
        return self.last_sync.as_metrics() if self.last_sync else {}


def merge_rank_metrics(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """One log row from every rank's sync metrics (:func:`hf_core.engines.worst_rank`): the
    worst rank's bytes and seconds, and zero redundancy only if it held on every rank."""
    return worst_rank(rows, lowest=("reshard/zero_redundancy",))
