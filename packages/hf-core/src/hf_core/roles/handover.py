"""The hybrid engine's memory hand-over, driven by the actor worker every step.

Training and generation share the actor's devices (HybridFlow §5): while the rollout engine
generates, the training engines' parameters, gradients and optimiser state are offloaded;
while they train, the rollout engine's weights and KV cache are released.  The worker moves
between the two phases; this class makes each move once, in a fixed order, and keeps a log
of what moved (bytes per engine and action; on a CPU-only run the engines move nothing and
report what they would move) and of each stage's peak memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Literal

from hf_core.device import reset_stage_peak, stage_peak_gib
from hf_core.engines import Offloadable, RolloutEngine, TrainingEngine, worst_rank

Phase = Literal["training", "generation"]


@dataclass(frozen=True)
class HandoverEvent:
    """One move: ``engine`` (actor, reference, rollout) did ``action`` of ``bytes``."""

    engine: str
    action: Literal["offload", "onload", "release", "resume"]
    bytes: int


class MemoryHandover:
    """Which phase the actor worker's devices are in, and the moves between phases."""

    def __init__(
        self,
        actor: TrainingEngine,
        reference: TrainingEngine | None,
        rollout: RolloutEngine | None,
        teacher: TrainingEngine | None = None,
    ) -> None:
        """``rollout`` is ``None`` when the rollout engines run in a pool of their own
        (``placement.mode: standalone``): then only the training engines move."""
        self.trainers: dict[str, Offloadable] = {}
        for name, engine in (("actor", actor), ("reference", reference), ("teacher", teacher)):
            if isinstance(engine, Offloadable):
                self.trainers[name] = engine
        self.rollout = rollout
        self.phase: Phase = "training"
        self.rollout_resident = True
        self.events: list[HandoverEvent] = []
        self.stage_peaks: dict[str, float] = {}

    def to_generation(self) -> None:
        """Offload the training engines and bring the rollout engine back (if not yet)."""
        if self.phase == "generation":
            return
        for name, engine in self.trainers.items():
            self._record(name, "offload", engine.offload())
        self.resume_rollout()
        self.phase = "generation"

    def to_training(self) -> None:
        """Release the rollout engine and onload the training engines (if not yet)."""
        if self.phase == "training":
            return
        if self.rollout is not None and self.rollout_resident:
            self._record("rollout", "release", self.rollout.release_memory())
            self.rollout_resident = False
        for name, engine in self.trainers.items():
            self._record(name, "onload", engine.onload())
        self.phase = "training"

    def after_sync(self) -> None:
        """A rollout engine in this process generates next: it gets the device; without one
        (the weights went to a pool) the training engines keep it for the next update."""
        if self.rollout is not None:
            self.to_generation()

    def resume_rollout(self) -> None:
        """Bring back the rollout engine's weights and KV cache (before a sync or generating)."""
        if self.rollout is not None and not self.rollout_resident:
            self._record("rollout", "resume", self.rollout.resume_memory())
            self.rollout_resident = True

    def _record(self, engine: str, action: str, nbytes: int | None) -> None:
        self.events.append(HandoverEvent(engine, action, int(nbytes or 0)))  # type: ignore[arg-type]

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Measure the peak memory of one stage (the highest over repeats since the last log)."""
        reset_stage_peak()
        try:
            yield
        finally:
            peak = stage_peak_gib()
            self.stage_peaks[name] = max(self.stage_peaks.get(name, 0.0), peak)

    def take_log(self) -> dict[str, object]:
        """Events and stage peaks since the last call, in order; then start afresh."""
        log: dict[str, object] = {
            "events": [asdict(e) for e in self.events],
            "stage_peaks_gib": dict(self.stage_peaks),
        }
        self.events, self.stage_peaks = [], {}
        return log


def handover_metrics(logs: list[dict[str, object]]) -> dict[str, float]:
    """Per-step metrics from every rank's log: bytes per engine and action
    (``handover/<engine>_<action>_bytes``, the largest rank's) and
    ``memory/<stage>_peak_gib`` (the largest rank's)."""
    return worst_rank(_rank_metrics(log) for log in logs)


def _rank_metrics(log: dict[str, object]) -> dict[str, float]:
    """One rank's log as a metric row: bytes summed per engine and action, stage peaks."""
    row: dict[str, float] = {}
    for event in log["events"]:  # type: ignore[attr-defined]
        key = f"handover/{event['engine']}_{event['action']}_bytes"
        row[key] = row.get(key, 0.0) + float(event["bytes"])
    for stage, peak in log["stage_peaks_gib"].items():  # type: ignore[attr-defined]
        row[f"memory/{stage}_peak_gib"] = float(peak)
    return row
