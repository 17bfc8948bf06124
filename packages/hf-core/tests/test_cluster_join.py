"""Joining a running Ray cluster (the multi-node path) with RAY_ADDRESS."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

DRIVER = textwrap.dedent(
    """
    import os
    from hf_core.runtime import Cluster, ResourcePool, spawn
    from workers_for_tests import ProbeWorker

    with Cluster() as cluster:  # no address given: RAY_ADDRESS decides
        assert cluster.address == os.environ["RAY_ADDRESS"], cluster.address
        pool = ResourcePool([2], name="joined")
        group = spawn(pool, {"probe": ProbeWorker})["probe"]
        print("RESULT", group.all_reduce_ranks())
        group.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(
    shutil.which("ray") is None and not Path(sys.executable).with_name("ray").exists(),
    reason="the ray CLI is not installed",
)
def test_driver_joins_a_cluster_started_with_ray_start(tmp_path: Path) -> None:
    ray_cli = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    tests_dir = str(Path(__file__).parent)
    # Every node must be able to import the worker classes (here: the tests folder).
    env = dict(
        os.environ,
        RAY_AUTH_MODE="disabled",
        PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
    )
    head_log = (tmp_path / "head.log").open("w")
    # Ray's unix socket paths must stay under ~107 characters: keep its folder short.
    ray_dir = tempfile.mkdtemp(prefix="hfj-", dir="/tmp")
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=4",
            "--block",
            "--include-dashboard=false",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={ray_dir}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        tests_dir = str(Path(__file__).parent)
        driver_env = dict(
            env,
            RAY_ADDRESS=f"127.0.0.1:{port}",
            PYTHONPATH=os.pathsep.join([tests_dir, env.get("PYTHONPATH", "")]),
        )
        result = subprocess.run(
            [sys.executable, "-c", DRIVER],
            env=driver_env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "RESULT [1, 1]" in result.stdout
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        head_log.close()
        shutil.rmtree(ray_dir, ignore_errors=True)
