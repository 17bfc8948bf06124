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
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_core.protocols import register
from hf_core.worker import Worker

TIMEOUT_S = 10.0
MARKER = "HF_TWO_NODES_TOKEN"
RAY_CLI = Path(sys.executable).with_name("ray")


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


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _ray_start(name: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``ray start --block`` in its own process group, with this test's marker and node name;
    every port it may listen on is chosen free (another Ray may run on this machine)."""
    agent, grpc, metrics, runtime_env, manager, objects = _free_ports(6)
    return subprocess.Popen(
        [
            str(RAY_CLI),
            "start",
            "--block",
            "--num-cpus=1",
            "--node-ip-address=127.0.0.1",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--node-manager-port={manager}",
            f"--object-manager-port={objects}",
            *args,
        ],
        env=dict(env, HF_TWO_NODES_NAME=name),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_started(node: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    """Until ``ray start`` says its node runs (a loaded machine may take a minute)."""
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in log.read_text():
        assert node.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def _marked_processes(token: str) -> dict[int, str]:
    """pid -> command of every live process carrying this test's marker (the nodes, their
    workers, the driver): read from /proc, which psutil would read too."""
    entry = f"{MARKER}={token}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or entry not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie holds nothing; its parent reaps it
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop(node: subprocess.Popen) -> None:
    if node.poll() is not None:
        return
    try:
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=10)
    except ProcessLookupError:
        pass


def _leftovers(token: str, grace_s: float) -> dict[int, str]:
    deadline = time.monotonic() + grace_s
    while (left := _marked_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.skipif(not RAY_CLI.exists(), reason="the ray CLI is not installed")
def test_ranks_on_two_nodes_and_a_lost_node_is_reported(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    tests_dir = str(Path(__file__).parent)
    env = dict(
        os.environ,
        RAY_AUTH_MODE="disabled",
        PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
        **{MARKER: token},
    )
    env.pop("RAY_ADDRESS", None)
    ray_dir = tempfile.mkdtemp(prefix="hf2n-", dir="/tmp")  # unix socket paths stay short
    port, client_port = _free_ports(2)
    nodes: list[subprocess.Popen] = []
    driver: subprocess.Popen | None = None
    try:
        head_args = [
            "--head",
            f"--port={port}",
            f"--ray-client-server-port={client_port}",
            "--include-dashboard=false",
            f"--temp-dir={ray_dir}",
        ]
        nodes.append(_ray_start("head", head_args, env, tmp_path / "head.log"))
        _wait_started(nodes[-1], tmp_path / "head.log")  # the others connect to it
        worker_args = [f"--address=127.0.0.1:{port}"]
        nodes.append(_ray_start("worker", worker_args, env, tmp_path / "worker.log"))
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(tmp_path / "stacks")],
            env=dict(env, RAY_ADDRESS=f"127.0.0.1:{port}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: list[str] = []
        assert driver.stdout is not None
        for line in driver.stdout:
            lines.append(line.rstrip())
            if line.startswith("RUNNING"):
                os.killpg(nodes[1].pid, signal.SIGKILL)  # the worker node, whole
                nodes[1].wait(timeout=10)
        driver.wait(timeout=120)
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
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        for node in reversed(nodes):
            _stop(node)
        left = _leftovers(token, grace_s=30.0)
        for pid in left:  # never leak: but the test fails below
            _kill(pid)
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert not left, left
