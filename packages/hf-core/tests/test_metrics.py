"""hf_core.metrics: the JSONL log, resume truncation, sinks, summary, plot and helpers."""

from __future__ import annotations

import io
import json
import math
import sys
import time

import numpy as np
import pytest
import torch

from hf_core.metrics import (
    MetricsLogger,
    MetricsSinkError,
    Timer,
    peak_memory,
    read_metrics_jsonl,
    summarize_learning,
    throughput,
    truncate_metrics_jsonl,
)


def _console():
    from rich.console import Console

    buffer = io.StringIO()
    return Console(file=buffer, width=140, force_terminal=False), buffer


def _rows(n):
    return [{"reward/mean": i / n, "perf/throughput": 1000.0 + i} for i in range(1, n + 1)]


# --------------------------------------------------------------------------- JSONL log


def test_jsonl_rows_round_trip(tmp_path):
    log = MetricsLogger(tmp_path, progress=False)
    log.log({"reward/mean": 0.25, "actor/loss": torch.tensor(-1.5), "n": np.int64(3)}, step=1)
    log.log({"reward/mean": 0.5, "actor/kl": math.nan, "flag": True}, step=2)
    # Every row is on disk (flushed) before close.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 1 and first["actor/loss"] == -1.5 and first["n"] == 3.0
    assert json.loads(lines[1])["actor/kl"] is None  # strict JSON: NaN is written as null
    log.close()

    rows = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.25 and rows[1]["flag"] == 1.0
    assert math.isnan(rows[1]["actor/kl"])
    assert all(abs(r["timestamp"] - time.time()) < 60 for r in rows)


def test_bad_metrics_and_steps_are_rejected(tmp_path):
    log = MetricsLogger(tmp_path, progress=False)
    with pytest.raises(TypeError, match="metric 'note' must be a number, got str"):
        log.log({"note": "hi"}, step=1)
    with pytest.raises(TypeError, match="metric 'vec'"):
        log.log({"vec": torch.zeros(3)}, step=1)
    log.log({"a": 1.0}, step=5)
    with pytest.raises(ValueError, match="step 5 logged after step 5"):
        log.log({"a": 1.0}, step=5)
    log.close()
    assert [r["step"] for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")] == [5]


def test_an_existing_log_needs_resume_or_overwrite(tmp_path):
    with MetricsLogger(tmp_path, progress=False) as log:
        log.log({"a": 1.0}, step=1)
    with pytest.raises(FileExistsError, match=r"resume_step=<step>.*overwrite=True"):
        MetricsLogger(tmp_path, progress=False)
    fresh = MetricsLogger(tmp_path, progress=False, overwrite=True)
    fresh.log({"a": 2.0}, step=1)
    fresh.close()
    assert [r["a"] for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")] == [2.0]


def test_resume_truncates_rows_after_the_checkpoint(tmp_path):
    log = MetricsLogger(tmp_path, progress=False)
    for step, row in enumerate(_rows(10), start=1):
        log.log(row, step=step)
    log.close()  # a crash after step 10; the checkpoint is from step 6

    resumed = MetricsLogger(tmp_path, progress=False, resume_step=6)
    assert [r["step"] for r in resumed.rows] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="step 6 logged after step 6"):
        resumed.log({"reward/mean": 0.0}, step=6)
    resumed.log({"reward/mean": 0.99}, step=7)
    resumed.close()
    rows = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert rows[6]["reward/mean"] == 0.99 and rows[5]["reward/mean"] == 0.6
    assert truncate_metrics_jsonl(tmp_path / "metrics.jsonl", 3) == 4
    assert truncate_metrics_jsonl(tmp_path / "metrics.jsonl", 3) == 0
    assert truncate_metrics_jsonl(tmp_path / "missing.jsonl", 3) == 0


def test_a_torn_last_line_is_trimmed_and_skipped(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    assert [r["step"] for r in read_metrics_jsonl(path)] == [1, 2]
    log = MetricsLogger(tmp_path, progress=False, resume_step=2)
    log.log({"a": 3.5}, step=3)
    log.close()
    assert path.read_text().splitlines()[-1].startswith('{"step": 3')
    assert [r.get("a") for r in read_metrics_jsonl(path)] == [1.0, 2.0, 3.5]

    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 2: malformed metrics row"):
        read_metrics_jsonl(path)


# ------------------------------------------------------------------- finish and sinks


def test_finish_prints_a_summary_and_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    console, buffer = _console()
    with MetricsLogger(tmp_path / "run", total_steps=20, console=console, run_name="demo") as log:
        for step, row in enumerate(_rows(20), start=1):
            log.log(row, step=step)
    out = buffer.getvalue()
    assert "step" in out and "20/20" in out  # the progress bar's last frame
    assert "demo: 20 steps" in out and "reward/mean" in out and "perf/throughput" in out
    # first 2 steps (0.05, 0.10) -> last 2 (0.95, 1.00)
    assert "first 2 steps 0.0750 -> last 2 steps 0.9750 (+0.9000, over 20 steps)" in out
    png = tmp_path / "run" / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5000
    assert f"plot: {png}" in out


def test_finish_without_matplotlib_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    console, buffer = _console()
    log = MetricsLogger(tmp_path, progress=False, console=console)
    log.log({"reward/mean": 1.0}, step=1)
    summary = log.finish()
    assert summary.plot_path is None
    assert "matplotlib is not installed" in summary.plot_error
    assert "pip install matplotlib" in buffer.getvalue()
    assert not (tmp_path / "metrics.png").exists()


@pytest.mark.parametrize(
    ("option", "module", "match"),
    [
        ("tensorboard", "torch.utils.tensorboard", "TensorBoard is not installed"),
        ("wandb", "wandb", "Weights & Biases is not installed"),
    ],
)
def test_a_requested_sink_that_is_missing_fails_clearly(
    tmp_path, monkeypatch, option, module, match
):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MetricsSinkError, match=f"{option}=True but {match}: pip install"):
        MetricsLogger(tmp_path, progress=False, **{option: True})
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing half-started


def test_tensorboard_sink_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, progress=False, tensorboard=True) as log:
        for step, row in enumerate(_rows(3), start=1):
            log.log(row, step=step)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [e.step for e in scalars] == [1, 2, 3]
    assert [e.value for e in scalars] == pytest.approx([1 / 3, 2 / 3, 1.0])


# ------------------------------------------------------------------------- helpers


def test_timer_throughput_and_memory():
    timings: dict[str, float] = {}
    with Timer("generate", timings) as t:
        time.sleep(0.02)
    with Timer("generate", timings):
        time.sleep(0.01)
    with Timer("update", timings):
        pass
    assert set(timings) == {"timing/generate", "timing/update"}
    assert t.seconds >= 0.02
    assert timings["timing/generate"] >= 0.03 and timings["timing/generate"] > t.seconds
    assert throughput(1000, 2.0) == 500.0 and throughput(1000, 2.0, num_devices=4) == 125.0
    with pytest.raises(ValueError, match="positive duration"):
        throughput(10, 0.0)
    memory = peak_memory()
    assert 0.01 < memory["memory/peak_rss_gib"] < 64  # this test process holds torch
    if not torch.cuda.is_available():
        assert "memory/peak_cuda_allocated_gib" not in memory


def test_summarize_learning():
    rows = [{"step": i, "reward/mean": float(i)} for i in range(20)]
    rows.insert(3, {"step": 99, "other": 1.0})  # rows without the key are skipped
    rows.append({"step": 100, "reward/mean": math.nan})
    summary = summarize_learning(rows)
    assert (summary.first, summary.last, summary.delta) == (0.5, 18.5, 18.0)
    assert (summary.window, summary.count) == (2, 20)
    quarter = summarize_learning(rows, frac=0.25)
    assert (quarter.first, quarter.last) == (2.0, 17.0)
    single = summarize_learning([{"step": 1, "reward/mean": 0.3}])
    assert single.delta == 0.0 and single.window == 1
    with pytest.raises(ValueError, match="no finite values of 'reward/mean'"):
        summarize_learning([{"step": 1}])
    with pytest.raises(ValueError, match="frac must be in"):
        summarize_learning(rows, frac=0.9)
