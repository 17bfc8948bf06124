"""Two Ray nodes on this machine: ranks on both, a collective across them, a node lost mid-run.

A head node (``ray start --head``) and a worker node (``ray start --address=...``), one CPU
each, so ``ResourcePool([1, 1])`` must put one rank on each.  The driver (a subprocess: the
test session may already hold its own Ray) runs an all-reduce across the nodes, then a long
call during which the test SIGKILLs the worker node; the controller must report the lost rank
within ``failure_timeout_s``.  Afterwards no process of either node may be left: every one
carries a marker in its environment, which the test looks for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_core.protocols import register
from hf_core.worker import Worker
from hf_testing.ray_nodes import RAY_CLI, two_ray_nodes

TIMEOUT_S = 10.0


class NodeWorker(Worker):
    """Imported by the worker processes of both nodes (the tests folder is on their path)."""

    @register("ONE_TO_ALL")
    def node_name(self) -> str:
        return os.environ.get("HF_TWO_NODES_NAME", "?")

    @register("ONE_TO_ALL")
    def all_reduce_ranks(self) -> int:
        value = torch.tensor([self.rank + 1])
        dist.all_reduce(value)
        return int(value.item())

    @register("ONE_TO_ALL")
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


DRIVER = textwrap.dedent(
    f"""
    import json, sys, time
    import ray
    from hf_core.runtime import Cluster, ResourcePool, WorkerLostError, spawn
    from test_two_nodes import NodeWorker

    with Cluster():  # RAY_ADDRESS: the head started by the test
        deadline = time.monotonic() + 120
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline, ray.nodes()
            time.sleep(0.5)
        pool = ResourcePool([1, 1], name="two_nodes", ready_timeout_s=120)
        group = spawn(
            pool, {{"node": NodeWorker}}, failure_timeout_s={TIMEOUT_S}, stacks_dir=sys.argv[1]
        )["node"]
        print("NODES", json.dumps(group.node_name()), flush=True)
        print("SUM", group.all_reduce_ranks(), flush=True)
        future = group.sleep.remote(300)
        time.sleep(1.0)  # both ranks are inside the call
        print("RUNNING", flush=True)
        start = time.monotonic()
        try:
            future.result()
            print("NOT REPORTED", flush=True)
        except WorkerLostError as exc:
            print("LOST", exc.rank, round(time.monotonic() - start, 1), flush=True)
            print("ERROR", str(exc).replace(chr(10), " "), flush=True)
        group.shutdown()
        pool.release()
    """
)


@pytest.mark.skipif(not RAY_CLI.exists(), reason="the ray CLI is not installed")
def test_ranks_on_two_nodes_and_a_lost_node_is_reported(tmp_path: Path) -> None:
    tests_dir = str(Path(__file__).parent)
    driver: subprocess.Popen | None = None
    with two_ray_nodes(tmp_path, pythonpath=[tests_dir]) as cluster:
        try:
            driver = subprocess.Popen(
                [sys.executable, "-c", DRIVER, str(tmp_path / "stacks")],
                env=dict(cluster.env, RAY_ADDRESS=cluster.address),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            lines: list[str] = []
            assert driver.stdout is not None
            for line in driver.stdout:
                lines.append(line.rstrip())
                if line.startswith("RUNNING"):
                    cluster.kill_worker_node()
            driver.wait(timeout=120)
        finally:
            if driver is not None and driver.poll() is None:
                driver.kill()
                driver.wait(timeout=30)
    out = "\n".join(lines)
    assert driver.returncode == 0, out + "\n" + (tmp_path / "worker.log").read_text()[-3000:]
    names = json.loads(next(x for x in lines if x.startswith("NODES")).split(" ", 1)[1])
    assert sorted(names) == ["head", "worker"], names  # one rank on each node
    assert "SUM [3, 3]" in lines, out  # 1 + 2 on each rank: all-reduced across the nodes
    lost = next((x for x in lines if x.startswith("LOST")), None)
    assert lost is not None, out
    _, rank, elapsed = lost.split()
    assert names[int(rank)] == "worker", out  # the rank on the killed node
    assert float(elapsed) < TIMEOUT_S + 8.0, out  # bound + heartbeat period + dump requests
    assert str(tmp_path / "stacks") in out
    assert not cluster.left, cluster.left  # nothing of either node survives
