"""The remote sandbox: the SandboxFusion ``run_code`` client, the recipe's ``sandbox:``
section, and the python tool and code_tests reward running through it."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_core.agents import tools as tools_mod
from hf_core.agents.config import AgentConfig, SandboxConfig
from hf_core.agents.loop import AgentLoop
from hf_core.agents.sandbox import SandboxLimits, run_python
from hf_core.agents.sandbox_choice import run_sandboxed, sandbox_in_use, use_sandbox
from hf_core.agents.sandbox_remote import RemoteSandbox, SandboxServiceError
from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.engines import NamedTensor, RolloutEngine, SamplingParams, assemble_rollout
from hf_core.engines.decoding import pack_responses, strip_left_padding
from hf_core.plugins.tools import get_tool, resolve_tools
from hf_core.rewards import RuleReward
from hf_core.rewards import code as code_reward
from hf_core.rewards.scorer import RewardFunctionError
from hf_core.tool_calls import format_tool_call

# the sandbox tests run alone (not beside pytest-xdist workers): some check that no sandbox
# process or cgroup of the machine outlives a call, which a neighbour's sandbox would break
pytestmark = pytest.mark.serial

# ------------------------------------------------------------------------ the service double


class FakeService(ThreadingHTTPServer):
    """A test double of a SandboxFusion service, not the service: ``POST /run_code`` runs the
    code with the local sandbox's :func:`run_python` and answers in the API's shape.  ``mode``
    makes it misbehave; ``requests`` records what it was sent."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode = "ok"
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeService

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(body)
            mode = self.server.mode
            if mode == "drop_once":
                self.server.mode = "ok"
        if self.path != "/run_code":
            return self._send(404, b'{"detail": "Not Found"}')
        if mode == "drop_once":  # hang up without an answer: a connection error
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        if mode == "500":
            return self._send(500, b"Internal Server Error")
        if mode == "garbage":
            return self._send(200, b"<html>not json</html>")
        if mode == "slow":
            time.sleep(2)
        if mode == "sandbox_error":
            answer: dict[str, Any] = {"status": "SandboxError", "message": "no runner left"}
            return self._send(200, json.dumps(answer).encode())
        limits = SandboxLimits(
            wall_seconds=body["run_timeout"],
            cpu_seconds=max(1, math.ceil(body["run_timeout"])),
            memory_mb=body["memory_limit_MB"] if body["memory_limit_MB"] > 0 else 512,
        )
        result = run_python(body["code"], limits)
        timed_out = result.killed == "wall"
        run = {
            "status": "TimeLimitExceeded" if timed_out else "Finished",
            "execution_time": result.seconds,
            "return_code": None if timed_out else result.exit_code,
            "stdout": result.stdout,
            "stderr": result.stderr,
        }
        status = "Success" if result.exit_code == 0 and not timed_out else "Failed"
        answer = {
            "status": status,
            "message": "",
            "compile_result": None,
            "run_result": run,
            "executor_pod_name": None,
            "files": {},
        }
        return self._send(200, json.dumps(answer).encode())

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def service() -> Iterator[FakeService]:
    server = FakeService()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def remote(service: FakeService) -> Iterator[FakeService]:
    """This process's sandbox set to the service, as a recipe's ``sandbox:`` would."""
    previous = use_sandbox(SandboxConfig(kind="remote", url=service.url, request_timeout_s=30))
    try:
        yield service
    finally:
        use_sandbox(previous)


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service is on loopback: a proxy from the environment must not carry the requests."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens: connections are refused


# ------------------------------------------------------------------------------- the client


def test_output_and_exit_code_round_trip(service: FakeService) -> None:
    sandbox = RemoteSandbox(service.url)
    limits = SandboxLimits(wall_seconds=5.0, memory_mb=256)
    ok = sandbox.run_python("print('hi')\nimport sys\nsys.stderr.write('oops')", limits)
    assert (ok.stdout, ok.stderr, ok.exit_code, ok.killed) == ("hi\n", "oops", 0, None)
    assert ok.isolation == ("remote",) and ok.ok
    failed = sandbox.run_python("import sys\nprint('bye')\nsys.exit(37)", limits)
    assert (failed.stdout, failed.exit_code, failed.killed, failed.ok) == ("bye\n", 37, None, False)
    assert service.requests[0] == {
        "code": "print('hi')\nimport sys\nsys.stderr.write('oops')",
        "language": "python",
        "run_timeout": 5.0,
        "memory_limit_MB": 256,
    }


def test_limits_map_to_killed(service: FakeService) -> None:
    sandbox = RemoteSandbox(service.url + "/")  # a trailing slash is not doubled
    start = time.monotonic()
    slow = sandbox.run_python("import time\ntime.sleep(30)", SandboxLimits(wall_seconds=1.0))
    assert slow.killed == "wall" and slow.exit_code < 0 and not slow.ok
    assert time.monotonic() - start < 10
    greedy = sandbox.run_python("x = bytearray(2**40)", SandboxLimits(memory_mb=256))
    assert greedy.killed == "memory" and greedy.exit_code != 0
    loud = sandbox.run_python("print('x' * 5000)", SandboxLimits(output_kb=1))
    assert len(loud.stdout) == 1024  # cut here, as the local sandbox caps its output


def test_a_refused_connection_is_retried_then_names_the_url() -> None:
    url = _closed_port_url()
    sandbox = RemoteSandbox(url, connect_retries=1)
    expected = re.escape(f"sandbox service at {url}/run_code could not be reached")
    with pytest.raises(SandboxServiceError, match=expected) as info:
        sandbox.run_python("print(1)")
    assert "tried 2 times" in str(info.value) and "ConnectionRefused" in str(info.value)


def test_a_dropped_connection_is_retried(service: FakeService) -> None:
    service.mode = "drop_once"
    result = RemoteSandbox(service.url, connect_retries=1).run_python("print(5)")
    assert result.stdout == "5\n" and len(service.requests) == 2


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("500", "answered HTTP 500 Internal Server Error: 'Internal Server Error'"),
        ("garbage", "answered something that is not JSON: '<html>not json</html>'"),
        ("sandbox_error", "reported SandboxError: 'no runner left'"),
    ],
)
def test_service_failures_raise_naming_the_url(
    service: FakeService, mode: str, message: str
) -> None:
    service.mode = mode
    with pytest.raises(SandboxServiceError) as info:
        RemoteSandbox(service.url, connect_retries=3).run_python("print(1)")
    assert str(info.value) == f"sandbox service at {service.url}/run_code {message}"
    assert len(service.requests) == 1  # only a failed connection is retried


def test_no_answer_within_the_request_timeout_raises(service: FakeService) -> None:
    service.mode = "slow"
    expected = r"did not answer within sandbox\.request_timeout_s=0\.5s"
    with pytest.raises(SandboxServiceError, match=expected):
        RemoteSandbox(service.url, request_timeout_s=0.5).run_python("print(1)")


def test_a_wrong_path_is_an_http_error(service: FakeService) -> None:
    sandbox = RemoteSandbox(service.url + "/v2")  # requests go to /v2/run_code: 404
    with pytest.raises(SandboxServiceError, match="answered HTTP 404"):
        sandbox.run_python("print(1)")


# ------------------------------------------------------------------------------ dispatching


def test_the_default_is_the_local_sandbox() -> None:
    assert sandbox_in_use().kind == "local"
    assert "remote" not in run_sandboxed("print(1)").isolation


def test_the_python_tool_runs_on_the_remote_service(
    remote: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = tools_mod.PYTHON_LIMITS.model_copy(update={"wall_seconds": 1.0})
    monkeypatch.setattr(tools_mod, "PYTHON_LIMITS", limits)
    tool = get_tool("python")
    assert asyncio.run(tool.call({"code": "print(6*7)"})).text == "42\n"
    err = asyncio.run(tool.call({"code": "1/0"}))
    assert err.status == "error" and "ZeroDivisionError" in err.text
    hang = asyncio.run(tool.call({"code": "import time\ntime.sleep(30)"}))
    assert hang.status == "timeout"
    assert [r["code"] for r in remote.requests] == [
        "print(6*7)",
        "1/0",
        "import time\ntime.sleep(30)",
    ]


def test_a_failing_service_fails_the_tool_call_loudly(remote: FakeService) -> None:
    remote.mode = "500"
    with pytest.raises(SandboxServiceError, match=re.escape(remote.url)):
        asyncio.run(get_tool("python").call({"code": "print(1)"}))


class _PythonCaller(RolloutEngine):
    """A fake engine: its first turn calls the python tool, its second says "done"."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        contexts = strip_left_padding(prompts["input_ids"], prompts["attention_mask"])
        tokens = []
        for context in contexts:
            answered = "<tool_response>" in self.tokenizer.decode(context)
            text = "done" if answered else format_tool_call("python", {"code": "print(6*7)"})
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens.append([*ids, self.tokenizer.eos_token_id])
        log_probs = [[-0.1] * len(t) for t in tokens]
        responses, lp, mask = pack_responses(
            tokens, log_probs, params.max_new_tokens, self.tokenizer.pad_token_id, torch.long
        )
        return assemble_rollout(prompts, responses, mask, lp, params.temperature)

    def load_weights(self, bucket: Iterable[NamedTensor]) -> None:
        pass


@pytest.mark.parametrize("continuous", [False, True])
def test_the_agent_loop_calls_the_service_and_stops_when_it_fails(
    remote: FakeService, continuous: bool
) -> None:
    from hf_testing.tiny import build_tokenizer

    tokenizer = build_tokenizer(256, tool_calls=True)
    config = AgentConfig(
        tools=["python"], tool_response_template="<tool_response>{result}</tool_response>"
    )
    config = config.model_copy(update={"continuous": continuous, "max_total_tokens": 200})
    loop = AgentLoop(_PythonCaller(tokenizer), tokenizer, config, resolve_tools(config.tools))
    ids = tokenizer("Q", add_special_tokens=False)["input_ids"]
    prompts = Batch({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids))})
    params = SamplingParams(max_new_tokens=64)
    batch = loop.generate(prompts, params)
    assert batch["tool_calls"][0][0]["result"] == "42\n" and len(remote.requests) == 1
    remote.mode = "500"  # the service breaks: the rollout fails, no error text for the model
    with pytest.raises(SandboxServiceError, match="answered HTTP 500"):
        loop.generate(prompts, params)


def test_workers_that_run_tools_take_the_recipes_sandbox(
    service: FakeService, tmp_path: Path
) -> None:
    """build_agent_loop (every worker that runs tools) sets the process's sandbox."""
    from hf_core.resharding import GenerationLayout
    from hf_core.roles.common import build_agent_loop
    from hf_testing.tiny import build_tokenizer

    build_tokenizer(256, tool_calls=True).save_pretrained(tmp_path)
    config = TrainerConfig.model_validate(
        {
            "model": {"path": str(tmp_path)},
            "reward": {"function": "code_tests"},
            "agent": {"tools": ["python"]},
            "sandbox": {"kind": "remote", "url": service.url},
        }
    )
    previous = sandbox_in_use()
    try:
        whole = GenerationLayout(pp=1, tp=1)
        assert build_agent_loop(config, whole, _PythonCaller(None)) is not None
        assert sandbox_in_use() == config.sandbox
        assert run_sandboxed("print(3)").isolation == ("remote",) and len(service.requests) == 1
    finally:
        use_sandbox(previous)


def test_the_code_reward_is_the_same_through_the_service(remote: FakeService) -> None:
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    partial = "def add(a, b):\n    return a + b if a else 0"
    hack = "import os\ndef add(a, b):\n    os._exit(0)"
    tests = ["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(0, 4) == 4"]
    responses, truths = [good, partial, hack], [tests] * 3
    through_service = code_reward.code_tests(responses, truths, {})
    assert len(remote.requests) == 9  # each test ran there
    previous = use_sandbox(None)
    try:
        local = code_reward.code_tests(responses, truths, {})
    finally:
        use_sandbox(previous)
    assert len(remote.requests) == 9
    assert list(through_service) == list(local) == [1.0, 2 / 3, 0.0]


def test_a_failing_service_is_no_silent_zero_reward(remote: FakeService) -> None:
    remote.mode = "sandbox_error"
    reward = RuleReward("code_tests")
    with pytest.raises(RewardFunctionError, match="SandboxServiceError: sandbox service at") as e:
        reward.score_texts(["def f():\n    return 1"], [["assert f() == 1"]])
    assert isinstance(e.value.__cause__, SandboxServiceError)
