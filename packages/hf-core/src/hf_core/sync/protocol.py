"""The one interface every way of moving weights from a training engine to a rollout engine has.

The actor worker holds one :class:`WeightSync`, chosen when it is built (in-process hybrid,
LoRA adapters only, or a broadcast to a rollout pool), and calls :meth:`WeightSync.run` after
each update without knowing which it holds.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class WeightSync(Protocol):
    """One weight sync from the actor's training engine to the rollout side.

    Every actor rank calls :meth:`run` together (exports and reshards run collectives).
    """

    def run(self, version: int = 0) -> dict[str, float]:
        """Move the weights of policy ``version`` (the actor's update count; only a rollout
        pool records it); this rank's sync metrics (``perf/weight_sync_s`` and whatever the
        transfer measured)."""
        ...
