"""The per-step metrics logger: JSONL always, TensorBoard / W&B optionally, a progress bar.

    with MetricsLogger("runs/ppo", total_steps=200, tensorboard=True) as log:
        for step in range(1, 201):
            ...
            log.log({"reward/mean": r, "perf/throughput": tps, **timings}, step=step)
    # on a clean exit: summary table printed, runs/ppo/metrics.png written

Resuming from a checkpoint at step ``k``: ``MetricsLogger(dir, resume_step=k)`` drops the log's
rows after step ``k`` (they belong to the lost future of the crashed run), keeps the earlier
ones for the summary and the plot, and starts TensorBoard with ``purge_step=k + 1``.  W&B
cannot rewind a run; pass ``wandb_kwargs={"id": ..., "resume": "allow"}`` to continue one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_core.metrics import summary as learning_summary
from hf_core.metrics.jsonl import (
    JsonlAppender,
    encode_row,
    read_metrics_jsonl,
    to_float,
    truncate_metrics_jsonl,
)

logger = logging.getLogger("hf_core.metrics")

DEFAULT_PROGRESS_KEYS = (
    learning_summary.REWARD_KEY,
    "actor/kl",
    "response_length/mean",
    learning_summary.THROUGHPUT_KEY,
)


class MetricsSinkError(RuntimeError):
    """A requested metrics sink (TensorBoard, W&B) is not installed or failed to start."""


@dataclass(frozen=True)
class RunSummary:
    """What :meth:`MetricsLogger.finish` reports."""

    steps: int
    first_step: int | None
    last_step: int | None
    wall_seconds: float
    jsonl_path: Path
    plot_path: Path | None
    plot_error: str | None
    learning: learning_summary.LearningSummary | None


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}" if abs(value) >= 100 else f"{value:.4f}"


class MetricsLogger:
    """Per-step metrics to a JSONL file (always) and optional sinks, with a progress bar.

    Args:
        log_dir: folder for ``metrics.jsonl``, ``metrics.png`` and ``tensorboard/``.
        total_steps: the number of steps, for the progress bar (``None``: no total).
        run_name: a name for W&B and the plot title.
        config: the run's config, given to W&B.
        tensorboard: also write TensorBoard scalars (needs the ``tensorboard`` package).
        wandb: also log to Weights & Biases (needs the ``wandb`` package).
        wandb_project / wandb_kwargs: passed to ``wandb.init``.
        progress: show a rich progress bar over steps.
        progress_keys: metrics shown beside the bar (those present in a step).
        resume_step: continue a run from this step (rows after it are dropped); ``None``
            starts a new log, and an existing non-empty log is then an error unless
            ``overwrite=True``.
        plot_keys: the metrics drawn by :meth:`finish`, one panel each.
        summary_keys: rows of the summary table (default: progress and plot keys).
        console: a ``rich.console.Console`` for the bar and the table (default: stderr).
        fsync: force every row to disk (off: rows are flushed to the OS, which survives a
            process crash but not a power cut).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        total_steps: int | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "hybridflow",
        wandb_kwargs: Mapping[str, Any] | None = None,
        progress: bool = True,
        progress_keys: Sequence[str] = DEFAULT_PROGRESS_KEYS,
        resume_step: int | None = None,
        overwrite: bool = False,
        plot_keys: Sequence[str] = (learning_summary.REWARD_KEY, learning_summary.THROUGHPUT_KEY),
        summary_keys: Sequence[str] | None = None,
        console: Any = None,
        fsync: bool = False,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        self.plot_path = self.log_dir / "metrics.png"
        self.total_steps = total_steps
        self.run_name = run_name or self.log_dir.name
        self.progress_keys = tuple(progress_keys)
        self.plot_keys = tuple(plot_keys)
        self.summary_keys = tuple(
            summary_keys
            if summary_keys is not None
            else dict.fromkeys([*self.progress_keys, *self.plot_keys])
        )
        self.rows: list[dict[str, Any]] = []
        """Every logged step, with only the keys the summary, table and plot read: the full
        rows are in the JSONL file, and a long run must not hold them all in memory."""
        self._kept = {"step", "timestamp", learning_summary.REWARD_KEY, *self.plot_keys}
        self._kept.update(self.summary_keys)
        self._start = time.monotonic()
        self._closed = False

        existing = self.jsonl_path.exists() and self.jsonl_path.stat().st_size > 0
        if resume_step is None and existing and not overwrite:
            raise FileExistsError(
                f"{self.jsonl_path} already holds a run's metrics; pass resume_step=<step> "
                "to continue it or overwrite=True to start over"
            )
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        self._console = console

        # Sinks that may fail are opened before the JSONL log is touched.
        self._tb = self._open_tensorboard(resume_step) if tensorboard else None
        try:
            self._wandb = (
                self._open_wandb(wandb_project, config, dict(wandb_kwargs or {})) if wandb else None
            )
        except BaseException:
            if self._tb is not None:
                self._tb.close()
            raise

        if resume_step is not None:
            removed = truncate_metrics_jsonl(self.jsonl_path, resume_step)
            if removed:
                logger.info(
                    "%s: dropped %d rows after step %d", self.jsonl_path, removed, resume_step
                )
            if self.jsonl_path.exists():
                self.rows = [self._summarised(row) for row in read_metrics_jsonl(self.jsonl_path)]
        elif existing:
            self.jsonl_path.unlink()  # overwrite=True
        self._last_step = self.rows[-1]["step"] if self.rows else resume_step
        self._jsonl = JsonlAppender(self.jsonl_path, fsync=fsync)
        self._progress: Any = None
        self._task: Any = None
        if progress:
            self._progress, self._task = self._open_progress(console, resume_step)

    # ------------------------------------------------------------------ sinks
    def _open_tensorboard(self, resume_step: int | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise MetricsSinkError(
                "tensorboard=True but TensorBoard is not installed: pip install tensorboard"
            ) from None
        purge = None if resume_step is None else resume_step + 1
        return SummaryWriter(log_dir=str(self.log_dir / "tensorboard"), purge_step=purge)

    def _open_wandb(
        self, project: str, config: Mapping[str, Any] | None, kwargs: dict[str, Any]
    ) -> Any:
        try:
            import wandb
        except ImportError:
            raise MetricsSinkError(
                "wandb=True but Weights & Biases is not installed: pip install wandb"
            ) from None
        kwargs.setdefault("project", project)
        kwargs.setdefault("name", self.run_name)
        kwargs.setdefault("dir", str(self.log_dir))
        if config is not None:
            kwargs.setdefault("config", dict(config))
        try:
            return wandb.init(**kwargs)
        except Exception as e:
            raise MetricsSinkError(f"wandb.init failed: {type(e).__name__}: {e}") from e

    def _open_progress(self, console: Any, resume_step: int | None) -> tuple[Any, Any]:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=console,
        )
        task = progress.add_task(
            "steps", total=self.total_steps, completed=resume_step or 0, metrics=""
        )
        progress.start()
        return progress, task

    # --------------------------------------------------------------- logging
    def log(self, metrics: Mapping[str, Any], step: int) -> dict[str, float]:
        """Record one step's metrics (numbers; tensors/numpy scalars are converted).

        Steps must increase.  The JSONL row is written and flushed before the other sinks
        are fed.  Returns the row's metrics as floats.
        """
        if self._closed:
            raise ValueError("log() after finish()/close()")
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} logged after step {self._last_step}; steps must increase"
            )
        values = {key: to_float(key, value) for key, value in metrics.items()}
        now = time.time()
        self._jsonl.write(encode_row(step, values, now))
        self._last_step = step
        self.rows.append(self._summarised({"step": step, "timestamp": now, **values}))
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._progress is not None:
            shown = " | ".join(
                f"{key} {_fmt(values[key])}" for key in self.progress_keys if key in values
            )
            self._progress.update(self._task, completed=step, metrics=shown)
        return values

    # -------------------------------------------------------------- finishing
    def _close_sinks(self) -> None:
        progress_sink = getattr(self, "_progress", None)  # None if __init__ failed early
        if progress_sink is not None:
            progress_sink.stop()
            self._progress = None
        tb_sink = getattr(self, "_tb", None)  # None if __init__ failed early
        if tb_sink is not None:
            tb_sink.close()
            self._tb = None
        wandb_sink = getattr(self, "_wandb", None)  # None if __init__ failed early
        if wandb_sink is not None:
            wandb_sink.finish()
            self._wandb = None
        if getattr(self, "_jsonl", None) is not None:
            self._jsonl.close()

    def close(self) -> None:
        """Stop the bar and close every sink (no summary, no plot)."""
        if not self._closed:
            self._closed = True
            self._close_sinks()

    def _summarised(self, row: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in row.items() if key in self._kept}

    def summary(self) -> RunSummary:
        learning = None
        try:
            learning = learning_summary.summarize_learning(self.rows, learning_summary.REWARD_KEY)
        except ValueError:
            pass
        steps = [row["step"] for row in self.rows]
        return RunSummary(
            steps=len(self.rows),
            first_step=steps[0] if steps else None,
            last_step=steps[-1] if steps else None,
            wall_seconds=time.monotonic() - self._start,
            jsonl_path=self.jsonl_path,
            plot_path=None,
            plot_error=None,
            learning=learning,
        )

    def finish(self, *, plot: bool = True, print_summary: bool = True) -> RunSummary:
        """Close the sinks, print a summary table and write the reward/throughput PNG.

        A missing matplotlib does not fail the run: the summary's ``plot_error`` says so and
        the table prints it.
        """
        self.close()
        summary = self.summary()
        plot_path, plot_error = None, None
        if plot:
            if not self.rows:
                plot_error = "no steps were logged"
            else:
                try:
                    plot_path = learning_summary.plot_metrics(
                        self.rows, self.plot_path, self.plot_keys, title=self.run_name
                    )
                except learning_summary.PlotUnavailableError as e:
                    plot_error = str(e)
                    logger.warning("%s", e)
        summary = dataclasses.replace(summary, plot_path=plot_path, plot_error=plot_error)
        if print_summary:
            self.print_summary(summary)
        return summary

    def print_summary(self, summary: RunSummary) -> None:
        from rich.table import Table

        console = self._console
        table = Table(
            title=f"{self.run_name}: {summary.steps} steps in {summary.wall_seconds:.1f} s"
        )
        for column in ("metric", "first", "last", "min", "max", "mean"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for key in self.summary_keys:
            values = [
                row[key]
                for row in self.rows
                if isinstance(row.get(key), float) and math.isfinite(row[key])
            ]
            if values:
                table.add_row(
                    key,
                    *(
                        _fmt(v)
                        for v in (
                            values[0],
                            values[-1],
                            min(values),
                            max(values),
                            sum(values) / len(values),
                        )
                    ),
                )
        console.print(table)
        if summary.learning is not None:
            console.print(str(summary.learning))
        console.print(f"metrics: {summary.jsonl_path}")
        if summary.plot_path is not None:
            console.print(f"plot: {summary.plot_path}")
        elif summary.plot_error is not None:
            console.print(f"plot: not written ({summary.plot_error})")

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass
