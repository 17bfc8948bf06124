"""GRPO across two Ray nodes: one rank on each, 3 steps, then the worker node is lost.

A head and a worker node run on this machine (``hf_testing.ray_nodes``), one CPU each, so
``placement.nodes: 2`` puts one actor rank on each.  ``hybridflow run`` joins them
(``cluster.address``); once step 3 is logged the test kills the worker node whole: the run
must end with exit code 1 and the lost rank named within the failure timeout, and nothing of
either node may be left running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LONG, RECIPES

from hf_testing.ray_nodes import RAY_CLI, two_ray_nodes

TIMEOUT_S = 10.0
STEPS = 100_000
"""More steps than the run can take before the test kills the worker node (it takes ~15 steps
a second here): a run that could finish first would race the kill and exit 0."""


@LONG  # the default run: hf-core's test_two_nodes (ranks on two nodes, a lost node reported)
@pytest.mark.skipif(not RAY_CLI.exists(), reason="the ray CLI is not installed")
def test_grpo_runs_across_two_nodes_and_a_lost_node_is_reported(
    workdir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "hf_core.cli",
        "run",
        str(RECIPES / "grpo.yaml"),
        f"run.output_dir={out}",
        f"run.total_steps={STEPS}",
        "run.val_every=0",
        "run.progress=false",
        "run.save_every=0",
        "run.max_restarts=0",
        "rollout.max_new_tokens=4",
        "placement.processes=2",
        "placement.nodes=2",
        f"cluster.failure_timeout_s={TIMEOUT_S}",
    ]
    with two_ray_nodes(tmp_path) as cluster:
        command.append(f"cluster.address={cluster.address}")
        driver = subprocess.Popen(
            command,
            cwd=workdir,  # the recipe's runs/assets
            env=dict(cluster.env, RAY_DEDUP_LOGS="0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            metrics = out / "metrics.jsonl"
            deadline = time.monotonic() + 300
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
                assert driver.poll() is None, driver.communicate()[0][-4000:]
                assert time.monotonic() < deadline, "3 steps did not finish in 300 s"
                time.sleep(0.5)
            cluster.kill_worker_node()
            killed = time.monotonic()
            text, _ = driver.communicate(timeout=120)
            elapsed = time.monotonic() - killed
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait(timeout=30)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows][:3] == [1, 2, 3]
    assert len(rows) < STEPS, "the run ended before the node was lost"
    assert all(r["reward/mean"] == r["reward/mean"] for r in rows)  # finite, logged
    assert driver.returncode == 1, text[-4000:]
    assert re.search(r"rank \d was lost during", text), text[-4000:]
    assert elapsed < TIMEOUT_S + 20.0, (elapsed, text[-2000:])  # + teardown of the driver
    assert "Traceback" not in text.split("error:")[-1], text[-4000:]
    assert not cluster.left, cluster.left
    assert os.path.exists(out / "error.log")
