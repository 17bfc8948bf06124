"""Summaries of a run's metric rows: did it learn, and a PNG of reward and throughput."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_core.atomic import replaced_atomically

REWARD_KEY = "reward/mean"
THROUGHPUT_KEY = "perf/throughput"


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed, so no plot can be drawn."""


@dataclass(frozen=True)
class LearningSummary:
    """Mean of ``key`` over the first and the last ``window`` rows, and their difference."""

    key: str
    first: float
    last: float
    delta: float
    window: int
    count: int

    def __str__(self) -> str:
        return (
            f"{self.key}: first {self.window} steps {self.first:.4f} -> last {self.window} steps "
            f"{self.last:.4f} ({self.delta:+.4f}, over {self.count} steps)"
        )


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    steps: list[float] = []
    values: list[float] = []
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            steps.append(float(row.get("step", len(steps))))
            values.append(float(value))
    return steps, values


def summarize_learning(
    rows: Sequence[Mapping[str, Any]], key: str = REWARD_KEY, frac: float = 0.1
) -> LearningSummary:
    """First-``frac`` mean, last-``frac`` mean and their difference for ``key``.

    Rows without a finite value for ``key`` are skipped; the window is
    ``max(1, round(frac * count))`` rows (the two windows overlap when there are very few).
    """
    if not 0 < frac <= 0.5:
        raise ValueError(f"frac must be in (0, 0.5], got {frac}")
    _, values = _series(rows, key)
    if not values:
        raise ValueError(f"no finite values of {key!r} in {len(rows)} metric rows")
    window = max(1, round(frac * len(values)))
    first = sum(values[:window]) / window
    last = sum(values[-window:]) / window
    return LearningSummary(key, first, last, last - first, window, len(values))


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(
    rows: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    keys: Sequence[str] = (REWARD_KEY, THROUGHPUT_KEY),
    title: str | None = None,
) -> Path:
    """Draw one panel per key against the step (with a moving average) and save a PNG.

    Uses matplotlib's object API with the Agg canvas (no pyplot, no display, no global backend
    change).  The PNG is written to a temporary file and swapped in.  Raises
    :class:`PlotUnavailableError` when matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailableError(
            "matplotlib is not installed, so no metrics plot was drawn: pip install matplotlib"
        ) from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7, 2.6 * max(1, len(keys))), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(keys)), 1, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys, strict=False):
        steps, values = _series(rows, key)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not values:
            ax.text(
                0.5, 0.5, f"no data for {key}", ha="center", va="center", transform=ax.transAxes
            )
            continue
        ax.plot(steps, values, color="tab:blue", alpha=0.45, linewidth=1, label=key)
        window = max(1, len(values) // 20)
        if window > 1:
            ax.plot(
                steps,
                _moving_average(values, window),
                color="tab:blue",
                linewidth=2,
                label=f"moving average ({window})",
            )
        ax.legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title)
    with replaced_atomically(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    return path
