"""Combining the metric rows of micro-batches, ranks and optimizer steps into one row.

Losses report plain floats per micro-batch; engines and role workers combine them over
micro-batches, data-parallel ranks and mini-batches.  Most are means; a key ending in
``_max`` is a maximum (e.g. ``rollout/logprob_abs_diff_max``), and a key ending in ``_sum``
or named in ``sums`` adds up.  One rule, so every engine reports the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def combine_metric_rows(
    rows: Iterable[Mapping[str, float]], sums: Iterable[str] = ()
) -> dict[str, float]:
    """One row from many: the mean of each key over the rows that have it, the maximum for
    ``*_max`` keys, the total for ``*_sum`` keys and those in ``sums``."""
    totals = set(sums)
    values: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            values.setdefault(key, []).append(float(value))
    out: dict[str, float] = {}
    for key, seen in values.items():
        if key.endswith("_max"):
            out[key] = max(seen)
        elif key.endswith("_sum") or key in totals:
            out[key] = sum(seen)
        else:
            out[key] = sum(seen) / len(seen)
    return out
