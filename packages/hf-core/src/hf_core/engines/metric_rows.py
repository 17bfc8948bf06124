"""Combining metric rows (``{name: float}``) of micro-batches, ranks and steps into one row.

The one home of these rules: backends' engines, role workers and the trainer all call them,
so every engine and role reports the same numbers.  It sits in the engines layer, the lowest
one all of them may import.

- :func:`combine_metric_rows`: losses report plain floats per micro-batch; engines and role
  workers combine them over micro-batches, data-parallel ranks and mini-batches.  Most are
  means; a key ending in ``_max`` is a maximum (e.g. ``rollout/logprob_abs_diff_max``), and a
  key ending in ``_sum`` or named in ``sums`` adds up.
- :func:`worst_rank`: costs where the largest rank counts (bytes moved, peak memory,
  seconds): the maximum over ranks, the minimum for flags that hold only if every rank's does.
- :func:`rank_zero_row`: rows the engines already all-reduced across ranks (every rank holds
  the same numbers): rank 0's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


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


def worst_rank(rows: Iterable[Mapping[str, float]], lowest: Iterable[str] = ()) -> dict[str, float]:
    """One row from every rank's: the maximum of each key over the ranks that report it (the
    largest, slowest rank counts), the minimum for keys in ``lowest``."""
    minima = set(lowest)
    out: dict[str, float] = {}
    for row in rows:
        for key, raw in row.items():
            value = float(raw)
            if key not in out:
                out[key] = value
            elif key in minima:
                out[key] = min(out[key], value)
            else:
                out[key] = max(out[key], value)
    return out


def rank_zero_row(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Rank 0's row, as floats: for metrics every rank already holds (the engines all-reduce
    them across data-parallel ranks, so one row is the combined one)."""
    return {key: float(value) for key, value in rows[0].items()}
