"""Per-step metrics: a JSONL log (always), TensorBoard and W&B (optional), a progress bar,
stage timers, throughput, peak memory, and an end-of-run summary with a reward/throughput plot.

Metric names are ``<group>/<name>`` (``reward/mean``, ``timing/generate``,
``perf/throughput``, ``memory/peak_rss_gib``).  Imports torch, numpy and rich; matplotlib,
TensorBoard and wandb only when used.
"""

from hf_core.metrics.jsonl import read_metrics_jsonl, truncate_metrics_jsonl
from hf_core.metrics.logger import (
    DEFAULT_PROGRESS_KEYS,
    MetricsLogger,
    MetricsSinkError,
    RunSummary,
)
from hf_core.metrics.perf import Timer, peak_memory, peak_rss_gib, throughput
from hf_core.metrics.summary import (
    REWARD_KEY,
    THROUGHPUT_KEY,
    LearningSummary,
    PlotUnavailableError,
    plot_metrics,
    summarize_learning,
)

__all__ = [
    "DEFAULT_PROGRESS_KEYS",
    "REWARD_KEY",
    "THROUGHPUT_KEY",
    "LearningSummary",
    "MetricsLogger",
    "MetricsSinkError",
    "PlotUnavailableError",
    "RunSummary",
    "Timer",
    "peak_memory",
    "peak_rss_gib",
    "plot_metrics",
    "read_metrics_jsonl",
    "summarize_learning",
    "throughput",
    "truncate_metrics_jsonl",
]
