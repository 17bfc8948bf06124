"""Two Ray nodes on one machine, for multi-node tests: a head and a worker node, one CPU each.

``ray start --block`` runs each node in its own process group with every port chosen free
(another Ray may run on this machine) and a marker in its environment, so the test can kill
the worker node whole and check afterwards that no process of either node is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "HF_TWO_NODES_TOKEN"
RAY_CLI = Path(sys.executable).with_name("ray")


@dataclass
class TwoNodes:
    """A running head + worker pair: ``address`` for drivers, ``env`` to start them with."""

    address: str
    env: dict[str, str]
    token: str
    nodes: list[subprocess.Popen] = field(default_factory=list)
    left: dict[int, str] = field(default_factory=dict)
    """Processes of either node still alive after teardown (filled on exit)."""

    def kill_worker_node(self) -> None:
        """SIGKILL the worker node's whole process group (raylet, workers)."""
        os.killpg(self.nodes[1].pid, signal.SIGKILL)
        self.nodes[1].wait(timeout=10)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _ray_start(name: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    agent, grpc, metrics, runtime_env, manager, objects = free_ports(6)
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


RAY_STARTUP_TIMEOUT = "timed out during startup"
"""What ``ray start`` says when its raylet did not register with the head within Ray's fixed
30 s (seen once in a full CI run on a loaded 2-core machine, never in isolation)."""


def _start_worker(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """The worker node, started once more if Ray's own 30-second registration wait ran out
    (the fixture's setup, not what the tests check); any other failure stays a failure."""
    node = _ray_start("worker", args, env, log)
    deadline = time.monotonic() + 180.0
    while "Ray runtime started" not in log.read_text() and node.poll() is None:
        if time.monotonic() > deadline:
            break  # _wait_started reports it
        time.sleep(0.5)
    if node.poll() is not None and RAY_STARTUP_TIMEOUT in log.read_text():
        first = log.read_text()
        node = _ray_start("worker", args, env, log)
        log.with_suffix(".first_attempt.log").write_text(first)
    _wait_started(node, log)
    return node


def marked_processes(token: str, marker: str = MARKER) -> dict[int, str]:
    """pid -> command of every live process whose environment holds ``marker=token`` (from
    /proc; zombies hold nothing and are skipped): everything a test or trial started."""
    entry = f"{marker}={token}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or entry not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


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
    while (left := marked_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@contextmanager
def two_ray_nodes(logs: Path, pythonpath: Sequence[str] = ()) -> Iterator[TwoNodes]:
    """Start a head and a worker node (one CPU each); on exit stop both, kill anything of
    theirs still alive after 30 s and record it in ``TwoNodes.left`` (the test asserts it is
    empty)."""
    token = uuid.uuid4().hex
    env = dict(
        os.environ,
        RAY_AUTH_MODE="disabled",
        PYTHONPATH=os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")]),
        **{MARKER: token},
    )
    env.pop("RAY_ADDRESS", None)
    ray_dir = tempfile.mkdtemp(prefix="hf2n-", dir="/tmp")  # unix socket paths stay short
    port, client_port = free_ports(2)
    cluster = TwoNodes(address=f"127.0.0.1:{port}", env=env, token=token)
    try:
        head_args = [
            "--head",
            f"--port={port}",
            f"--ray-client-server-port={client_port}",
            "--include-dashboard=false",
            f"--temp-dir={ray_dir}",
        ]
        cluster.nodes.append(_ray_start("head", head_args, env, logs / "head.log"))
        _wait_started(cluster.nodes[-1], logs / "head.log")  # the worker connects to it
        worker_args = [f"--address={cluster.address}"]
        cluster.nodes.append(_start_worker(worker_args, env, logs / "worker.log"))
        yield cluster
    finally:
        for node in reversed(cluster.nodes):
            _stop(node)
        cluster.left = _leftovers(token, grace_s=30.0)
        for pid in cluster.left:  # never leak: the test fails on ``left`` instead
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_dir, ignore_errors=True)
