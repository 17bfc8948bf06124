"""One log row from every actor (and rollout) rank's sync metrics.

Each rank measures its own sync; the trainer logs one row per step, so the rows are merged
here, next to the syncs that produce them.
"""

from __future__ import annotations

from collections.abc import Sequence


def merge_rank_metrics(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """One row for the log from every rank's sync: zero redundancy only if on every rank,
    everything else the worst rank's (bytes and seconds: the maximum)."""
    merged: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key not in merged:
                merged[key] = value
            elif key == "reshard/zero_redundancy":
                merged[key] = min(merged[key], value)
            else:
                merged[key] = max(merged[key], value)
    return merged
