"""The soak harness, short: the demo workload for a few steps with checkpoints, every process
of the run sampled (``nox -s soak`` runs 3,000 steps); and its growth check on made-up series,
so a leak is caught and a flat run passes."""

from __future__ import annotations

from pathlib import Path

from conftest import ROOT, load_script


def _soak():
    return load_script(ROOT / "faults" / "soak.py")


def test_the_growth_check_catches_a_leak_and_passes_a_flat_run() -> None:
    soak = _soak()

    def series(rss: list[float], fds: list[int]) -> list:
        worker = "7 ray::WorkerProcess"
        return [
            soak.Sample(float(t), t, 100.0, {worker: {"rss_mib": r, "fds": f, "threads": 9}})
            for t, (r, f) in enumerate(zip(rss, fds, strict=True))
        ]

    flat = series([500.0 + (t % 3) for t in range(40)], [30] * 40)
    assert soak.growth_report(flat, warmup=0.1, max_growth=0.05) == []
    leaking = series([500.0 + 5 * t for t in range(40)], [30 + t for t in range(40)])
    problems = soak.growth_report(leaking, warmup=0.1, max_growth=0.05)
    assert any("total rss_mib" in p for p in problems)
    assert any("WorkerProcess fds" in p for p in problems)


def test_a_short_soak_samples_every_process_of_the_run(tmp_path: Path) -> None:
    """No growth bound here: the short run is mostly start-up (Ray, the models, the warm
    start), and Ray maps its object store's shared memory (~256 MiB) during the first steps,
    so any window comparison spans that one-time mapping.  Growth is judged by ``nox -s soak``
    and, here, on made-up series."""
    soak = _soak()
    code = soak.main(
        [
            "--steps",
            "12",
            "--save-every",
            "4",
            "--interval",
            "1",
            "--max-growth",
            "inf",
            "--workdir",
            str(tmp_path),
        ]
    )
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert (tmp_path / "soak.png").stat().st_size > 0
    assert len(list((tmp_path / "run" / "checkpoints").glob("step_*"))) >= 1
