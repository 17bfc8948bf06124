"""A vLLM engine that fails inside its worker's process heals like a lost worker.

In hybrid mode vLLM's engine core runs in the actor's own process: a failure in the middle of
an engine step is an exception there, and the process lives on with an engine that cannot
serve again (requests still scheduled).  The run must treat that rank as lost -- report
"engine died" with the cause, replace the workers, resume from the latest checkpoint -- and
finish.  The fault is injected from outside the product's code: ``vllm_fault/sitecustomize.py``
makes vLLM's model runner raise once when a marker file appears (created here after step 3).
The run is a separate ``hybridflow run`` process with its own Ray instance, since only that
run's processes may carry the fault.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from conftest import LONG, RECIPES, logged_step_reached

pytest.importorskip("hf_vllm")

FAULT_DIR = Path(__file__).with_name("vllm_fault")
STEPS, SAVE_EVERY, FAULT_AFTER_STEP = 6, 2, 3


@LONG  # the default run: test_self_healing's killed worker restarted to an equal run
def test_a_vllm_engine_that_dies_in_its_process_is_replaced_and_the_run_finishes(
    in_workdir: Path,
) -> None:
    out = in_workdir / "runs" / "engine_death"
    marker = in_workdir / "vllm_fault.marker"
    ray_tmp = tempfile.mkdtemp(prefix="hfe-", dir="/tmp")  # short unix socket paths
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(FAULT_DIR), os.environ.get("PYTHONPATH", "")]),
        HF_TEST_VLLM_FAULT=str(marker),
        RAY_TMPDIR=ray_tmp,
        RAY_AUTH_MODE="disabled",
    )
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable,
        "-m",
        "hf_core.cli",
        "run",
        str(RECIPES / "grpo_vllm.yaml"),
        f"run.output_dir={out}",
        f"run.total_steps={STEPS}",
        f"run.save_every={SAVE_EVERY}",
        "run.max_restarts=1",
        "run.val_every=0",
        "run.progress=false",
        "rollout.max_new_tokens=4",
        "cluster.failure_timeout_s=30",
    ]
    stop = threading.Event()

    def inject() -> None:
        while not stop.wait(0.05):
            if logged_step_reached(out, FAULT_AFTER_STEP):
                marker.touch()
                return

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    try:
        done = subprocess.run(
            cmd, env=env, cwd=in_workdir, capture_output=True, text=True, timeout=900
        )
    finally:
        stop.set()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert not marker.exists(), "the fault never fired: the marker is still there"
    assert "engine died: vLLM's engine failed while generating" in log, log[-6000:]
    assert "injected fault inside vLLM's model runner" in log
    assert "restart 1/1" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # nothing lost
