"""The policy endpoint does not trust what agent code sends it.

Each test is an attack one agent (or any local client) could make, and the endpoint's answer:
token ids the engine cannot embed, writing into a sibling's trajectory, opening trajectories
that are never taken, prompts far over the limits, a chunked body that never ends, JSON nested
deeper than the parser's recursion.  Agent functions run through :class:`FunctionAgentLoop`
(the framework's own wiring); the engine is test_serving's scripted one, made to fail the way a
real one does on an id outside its vocabulary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_serving import GOOD, ScriptedEngine, _calculator_agent, _endpoint

from hf_core.agents.config import AgentConfig
from hf_core.agents.function_agents import FunctionAgentLoop
from hf_core.batch import Batch
from hf_core.engines.decoding import left_padded, strip_left_padding
from hf_core.engines.rollout import SamplingParams, assemble_rollout
from hf_core.serving import (
    EndpointLimits,
    EndpointServer,
    EngineBatcher,
    PolicyEndpoint,
)
from hf_testing.tiny import CHAT_TEMPLATE, build_tokenizer

openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = build_tokenizer(vocab_size=VOCAB, tool_calls=True)
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) == VOCAB
    return tok


class EmbeddingEngine(ScriptedEngine):
    """The scripted engine, failing a whole call on an id outside the vocabulary as an
    embedding lookup does; it records every context and ``max_new_tokens`` it was given."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.contexts: list[list[int]] = []
        self.max_new_tokens: list[int] = []

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        rows = strip_left_padding(prompts["input_ids"], prompts["attention_mask"])
        self.contexts += rows
        self.max_new_tokens.append(params.max_new_tokens)
        for row in rows:
            if any(not 0 <= t < VOCAB for t in row):
                raise IndexError("index out of range in self")
        if all("user\n" in self.tokenizer.decode(row) for row in rows):
            return super().generate(prompts, params)
        # raw token prompts: answer each with "7" and the stop token
        ids = [*self.tokenizer("7", add_special_tokens=False)["input_ids"]]
        ids = [*ids, self.tokenizer.eos_token_id][: params.max_new_tokens]
        responses = torch.tensor([ids] * len(rows))
        mask = torch.ones_like(responses)
        log_probs = torch.full(responses.shape, -0.5)
        return assemble_rollout(prompts, responses, mask, log_probs, params.temperature)


def _run_agents(
    tokenizer: Any,
    engine: ScriptedEngine,
    function: str,
    questions: list[str],
    *,
    max_total_tokens: int = 96,
    loop_out: list[FunctionAgentLoop] | None = None,
) -> Batch:
    """One rollout step of agent function ``function`` (in this module), one run per
    question."""
    config = AgentConfig(
        function=f"{__name__}:{function}",
        timeout_s=10.0,
        max_turns=4,
        max_total_tokens=max_total_tokens,
    )
    loop = FunctionAgentLoop(engine, tokenizer, config)  # type: ignore[arg-type]
    try:
        rows = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
        out = loop.generate(left_padded(rows, tokenizer.pad_token_id), SamplingParams(n=1))
        if loop_out is not None:
            loop_out.append(loop)
        return out
    finally:
        loop.close()


SEEN: dict[str, Any] = {}
"""What agent runs of one test share (a leaked URL, the status codes they got)."""


def _own_id(client: Any) -> str:
    match = re.search(r"/t/([^/]+)/v1", str(client.base_url))
    assert match, client.base_url
    return match.group(1)


def _root(client: Any) -> str:
    return str(client.base_url).split("/t/", 1)[0] + "/v1"


async def _status_of(request: Any) -> int:
    """The HTTP status a request got (200 when it succeeded)."""
    try:
        await request
    except openai.APIStatusError as exc:
        SEEN.setdefault("messages", []).append(exc.message)
        return int(exc.status_code)
    return 200


# ------------------------------------------------------------------ vocabulary


async def vocabulary_agent(client: Any, sample: dict[str, Any]) -> float:
    """'bad' sends token ids outside the vocabulary; the others are honest calculator agents."""
    if sample["prompt"] == "bad":
        await client.completions.create(model="policy", prompt=[5, 6, VOCAB + 7], max_tokens=4)
        return 1.0
    return 1.0 if await _calculator_agent(client, sample["prompt"]) else 0.0


def test_token_ids_outside_the_vocabulary_are_refused_before_batching(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An id the engine cannot embed used to join the others' engine call and fail all of
    them (500s); it is a 400 naming the id and the vocabulary, and the engine never sees it."""
    monkeypatch.setattr("hf_core.serving.batching.GATHER_WINDOW_S", 0.5)  # one call for both
    engine = EmbeddingEngine(tokenizer)
    out = _run_agents(tokenizer, engine, "vocabulary_agent", ["bad", "12*34="])
    assert out["agent_failed"].tolist() == [True, False], out["agent_error"]
    assert out["agent_reward"].tolist() == [0.0, 1.0]
    error = out["agent_error"][0]
    assert "400" in error and f"id {VOCAB + 7}" in error and f"< {VOCAB}" in error, error
    assert all(max(c) < VOCAB for c in engine.contexts)


@pytest.mark.parametrize("prompt", [[-1], [3, True], [3, 2.0], [], [VOCAB]])
def test_prompt_ids_must_be_integers_inside_the_vocabulary(
    tokenizer: Any, prompt: list[Any]
) -> None:
    engine = EmbeddingEngine(tokenizer)
    endpoint, app = _endpoint_app(tokenizer, engine)
    ticket = endpoint.open()
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        reply = client.post(
            f"/t/{ticket.id}/v1/completions",
            json={"model": "policy", "prompt": prompt},
            headers={"Authorization": f"Bearer {ticket.key}"},
        )
    assert reply.status_code == 400, reply.text
    assert engine.contexts == []
    trajectory = endpoint.take(ticket.id)
    assert trajectory is not None and trajectory.prompt == [] and trajectory.requests == 0


# ---------------------------------------------------------------- trajectory ids


async def intruder_agent(client: Any, sample: dict[str, Any]) -> float:
    """'intruder' writes into its sibling's trajectory before the sibling asks; 'victim' is an
    honest calculator agent (that waits a little, and leaks its base URL)."""
    if sample["prompt"] != "intruder":
        SEEN["victim"] = _own_id(client)
        await asyncio.sleep(0.5)
        return 1.0 if await _calculator_agent(client, sample["prompt"]) else 0.0
    own = _own_id(client)
    if SEEN["how"] == "guessed":  # ids that count up: the sibling's is the next number
        match = re.fullmatch(r"(.*)-(\d+)", own)
        target = f"{match.group(1)}-{int(match.group(2)) + 1}" if match else f"{own}-1"
    else:  # the sibling's id leaked (a log line): it must be of no use without its key
        for _ in range(100):
            if "victim" in SEEN:
                break
            await asyncio.sleep(0.01)
        target = SEEN["victim"]
    intruder = openai.AsyncOpenAI(
        base_url=f"{_root(client)[: -len('/v1')]}/t/{target}/v1",
        api_key=client.api_key,
        max_retries=0,
    )
    async with intruder:
        messages = [{"role": "user", "content": "1*1="}, {"role": "assistant", "content": "1"}]
        SEEN["intruder"] = await _status_of(
            intruder.chat.completions.create(model="policy", messages=messages)
        )
    return 1.0


@pytest.mark.parametrize(("how", "status"), [("guessed", 404), ("leaked", 403)])
def test_an_agent_cannot_write_into_a_sibling_trajectory(
    tokenizer: Any, how: str, status: int
) -> None:
    """Ids were ``<call>-<row>``: an agent wrote into the next row's trajectory and made its
    next request fail.  Now the id cannot be guessed, and a known id is refused without the
    trajectory's own key; the sibling's trajectory is untouched."""
    SEEN.clear()
    SEEN["how"] = how
    engine = EmbeddingEngine(tokenizer)
    out = _run_agents(tokenizer, engine, "intruder_agent", ["intruder", "12*34="])
    assert SEEN["intruder"] == status, SEEN
    assert out["agent_failed"].tolist() == [False, False], out["agent_error"]
    assert out["agent_reward"].tolist() == [1.0, 1.0]
    assert "1*1=" not in out["trajectory"][1]
    assert out["agent_turns"].tolist() == [0, 2]


def test_trajectory_ids_and_keys_are_random_and_distinct(tokenizer: Any) -> None:
    endpoint, _ = _endpoint_app(tokenizer, EmbeddingEngine(tokenizer))
    tickets = [endpoint.open() for _ in range(50)]
    ids = {t.id for t in tickets}
    keys = {t.key for t in tickets}
    assert len(ids) == len(keys) == 50 and not ids & keys
    assert all(len(t.id) >= 20 and len(t.key) >= 30 for t in tickets)
    assert all(t.key not in repr(t) for t in tickets)  # a logged ticket does not leak its key
    assert len({t.id[:8] for t in tickets}) == 50  # no shared, countable prefix


async def stale_agent(client: Any, sample: dict[str, Any]) -> float:
    """Keeps its client's URL and key, and uses them again in the next rollout step."""
    if "stale" not in SEEN:
        SEEN["stale"] = (str(client.base_url), client.api_key)
        return 1.0
    url, key = SEEN["stale"]
    async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as old:
        SEEN["reused"] = await _status_of(
            old.chat.completions.create(model="policy", messages=GOOD["messages"])
        )
    return 1.0


def test_a_trajectory_of_an_earlier_run_is_refused(tokenizer: Any) -> None:
    """A trajectory belongs to the agent run it was opened for: once the run's results are
    taken, its URL and key open nothing (before, the request re-created it, and it stayed)."""
    SEEN.clear()
    engine = EmbeddingEngine(tokenizer)
    config = AgentConfig(function=f"{__name__}:stale_agent", timeout_s=10.0, max_turns=2)
    loop = FunctionAgentLoop(engine, tokenizer, config)  # type: ignore[arg-type]
    try:
        prompts = left_padded([tokenizer("1*2=")["input_ids"]], tokenizer.pad_token_id)
        loop.generate(prompts, SamplingParams())
        loop.generate(prompts, SamplingParams())
        assert 400 <= SEEN["reused"] < 500, SEEN
        assert loop.endpoint.trajectories == {}
        assert engine.contexts == []
    finally:
        loop.close()


# ------------------------------------------------------------ open trajectories


async def hoarding_agent(client: Any, sample: dict[str, Any]) -> float:
    """Names trajectories of its own making, through the header and the ``user`` field."""
    root = openai.AsyncOpenAI(base_url=_root(client), api_key=client.api_key, max_retries=0)
    statuses = []
    async with root:
        for i in range(10):
            statuses.append(
                await _status_of(
                    root.chat.completions.create(
                        model="policy",
                        messages=[{"role": "user", "content": "2*3="}],
                        extra_headers={"X-Trajectory-Id": f"mine-{i}"},
                    )
                )
            )
            statuses.append(
                await _status_of(
                    root.chat.completions.create(
                        model="policy",
                        messages=[{"role": "user", "content": "2*3="}],
                        user=f"also-mine-{i}",
                    )
                )
            )
    SEEN["hoarded"] = statuses
    return 1.0


def test_agents_cannot_open_trajectories_that_nobody_takes(tokenizer: Any) -> None:
    """Any name used to open a trajectory that nobody would take or evict; now only the
    framework opens them (one per agent run) and the endpoint is empty after the step."""
    SEEN.clear()
    loops: list[FunctionAgentLoop] = []
    engine = EmbeddingEngine(tokenizer)
    _run_agents(tokenizer, engine, "hoarding_agent", ["2*3="], loop_out=loops)
    assert SEEN["hoarded"] == [404] * 20
    assert loops[0].endpoint.trajectories == {}
    assert engine.contexts == []


def test_open_trajectories_are_capped_and_finished_ones_evicted(tokenizer: Any) -> None:
    engine = EmbeddingEngine(tokenizer)
    endpoint, app = _endpoint_app(tokenizer, engine, max_trajectories=2)
    a, b = endpoint.open(), endpoint.open()
    with pytest.raises(RuntimeError, match=r"at most 2 \(max_trajectories\)"):
        endpoint.open()  # both live: nothing to evict
    endpoint.finish(a.id)
    c = endpoint.open()  # the finished one makes room
    assert set(endpoint.trajectories) == {b.id, c.id}
    assert endpoint.take(a.id) is None
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        evicted = client.post(f"/t/{a.id}/v1/chat/completions", json=GOOD, headers=_bearer(a.key))
        assert evicted.status_code == 401  # its key went with it
        endpoint.finish(b.id)
        closed = client.post(f"/t/{b.id}/v1/chat/completions", json=GOOD, headers=_bearer(b.key))
        assert closed.status_code == 409, closed.text
        assert "over" in closed.json()["error"]["message"]
        live = client.post(f"/t/{c.id}/v1/chat/completions", json=GOOD, headers=_bearer(c.key))
        assert live.status_code == 200, live.text
    finished = endpoint.take(b.id)
    assert finished is not None and finished.requests == 0 and finished.prompt == []
    assert len(engine.contexts) == 1


def test_a_key_acts_on_its_own_trajectory_only(tokenizer: Any) -> None:
    endpoint, app = _endpoint_app(tokenizer, EmbeddingEngine(tokenizer))
    mine, other = endpoint.open(), endpoint.open()
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        for named in (
            {"path": f"/t/{other.id}/v1/chat/completions", "json": GOOD},
            {
                "path": "/v1/chat/completions",
                "json": GOOD,
                "headers": {"X-Trajectory-Id": other.id},
            },
            {"path": "/v1/chat/completions", "json": {**GOOD, "user": other.id}},
        ):
            headers = {**_bearer(mine.key), **named.get("headers", {})}
            reply = client.post(named["path"], json=named["json"], headers=headers)
            assert reply.status_code == 403, reply.text
            assert "another agent run" in reply.json()["error"]["message"]
        # the key alone names its trajectory
        own = client.post("/v1/chat/completions", json=GOOD, headers=_bearer(mine.key))
        assert own.status_code == 200, own.text
    untouched = endpoint.take(other.id)
    assert untouched is not None and untouched.requests == 0 and untouched.messages == []
    used = endpoint.take(mine.id)
    assert used is not None and used.requests == 1


# ---------------------------------------------------------------- prompt sizes


async def long_prompt_agent(client: Any, sample: dict[str, Any]) -> float:
    """Sends a first prompt far over ``agent.max_total_tokens`` (64): chat or token ids."""
    if sample["prompt"] == "chat":
        content = "1*1=" + " 12*34" * 400
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": content}]
        )
    else:
        await client.completions.create(model="policy", prompt=[40] * 5000, max_tokens=4)
    return 1.0


def test_a_prompt_over_the_limit_is_refused_before_the_engine(tokenizer: Any) -> None:
    """A prompt had no size limit (900,018 tokens were accepted against max_total_tokens
    1024); now it is a 400 naming the limit, and the engine never sees it."""
    engine = EmbeddingEngine(tokenizer)
    out = _run_agents(tokenizer, engine, "long_prompt_agent", ["chat", "ids"], max_total_tokens=64)
    assert out["agent_failed"].tolist() == [True, True]
    for error in out["agent_error"]:
        assert "400" in error and "at most 64 (agent.max_total_tokens)" in error, error
    assert engine.contexts == []


def test_the_engine_capacity_bounds_contexts_and_completions(tokenizer: Any) -> None:
    engine = EmbeddingEngine(tokenizer)
    limits = EndpointLimits(max_total_tokens=200, max_new_tokens=64, capacity=40)
    endpoint, app = _endpoint_app(tokenizer, engine, limits=limits)
    big, fits = endpoint.open(), endpoint.open()
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        refused = client.post(
            f"/t/{big.id}/v1/completions",
            json={"model": "policy", "prompt": [40] * 40},
            headers=_bearer(big.key),
        )
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "40 tokens" in message and "capacity" in message, message
        served = client.post(
            f"/t/{fits.id}/v1/completions",
            json={"model": "policy", "prompt": [40] * 30},
            headers=_bearer(fits.key),
        )
        assert served.status_code == 200, served.text
    assert engine.max_new_tokens == [10]  # cut to the room the engine has left
    assert [len(c) for c in engine.contexts] == [30]


def test_the_agent_loop_passes_the_engine_capacity_through(tokenizer: Any) -> None:
    config = AgentConfig(function=f"{__name__}:long_prompt_agent", max_total_tokens=64)
    loop = FunctionAgentLoop(EmbeddingEngine(tokenizer), tokenizer, config, capacity=50)  # type: ignore[arg-type]
    try:
        rows = [tokenizer("ids", add_special_tokens=False)["input_ids"]]
        loop.generate(left_padded(rows, tokenizer.pad_token_id), SamplingParams(max_new_tokens=8))
        assert loop.endpoint.limits.capacity == 50
        assert loop.endpoint.limits.max_new_tokens == 8
    finally:
        loop.close()


# ------------------------------------------------------------------ the HTTP layer


def _endpoint_app(
    tokenizer: Any,
    engine: ScriptedEngine,
    *,
    limits: EndpointLimits | None = None,
    max_trajectories: int | None = None,
    max_body_bytes: int = 4096,
) -> tuple[PolicyEndpoint, Any]:
    from hf_core.serving.app import build_app

    cap = {} if max_trajectories is None else {"max_trajectories": max_trajectories}
    endpoint = _endpoint(tokenizer, engine, limits or EndpointLimits(), **cap)
    _BATCHERS.append(endpoint.batcher)
    app = build_app(endpoint, token="secret", model_name="policy", max_body_bytes=max_body_bytes)
    return endpoint, app


_BATCHERS: list[EngineBatcher] = []


@pytest.fixture(autouse=True)
def _close_batchers() -> Any:
    """Each test's engine threads end with it."""
    yield
    while _BATCHERS:
        _BATCHERS.pop().close()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _nested(depth: int) -> str:
    """A chat request whose message content is ``depth`` arrays deep."""
    content = "[" * depth + "]" * depth
    return '{"model": "policy", "messages": [{"role": "user", "content": ' + content + "}]}"


@pytest.mark.parametrize(
    "body",
    [
        "[" * 100_000,
        '{"a":' * 100_000,
        _nested(100_000),
        _nested(900),
        json.dumps(GOOD)[:-1] + ', "max_tokens": ' + "7" * 5000 + "}",
        json.dumps({**GOOD, "temperature": 1})[:-2] + "Infinity}",
        b'{"model": "policy", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        "",
    ],
    ids=["arrays", "objects", "deep-content", "900-deep-content", "huge-int", "inf", "utf8", ""],
)
def test_malformed_json_of_any_depth_is_a_400(tokenizer: Any, body: str | bytes) -> None:
    engine = EmbeddingEngine(tokenizer)
    _, app = _endpoint_app(tokenizer, engine, max_body_bytes=1 << 20)
    with TestClient(app, client=("127.0.0.1", 5000), raise_server_exceptions=False) as client:
        reply = client.post("/t/x/v1/chat/completions", content=body, headers=_bearer("secret"))
        assert reply.status_code == 400, reply.text[:300]
        assert reply.json()["error"]["message"]
        assert client.get("/v1/models", headers=_bearer("secret")).status_code == 200
    assert engine.contexts == []


@pytest.mark.parametrize(
    ("messages", "status"),
    [
        ([{"role": "user", "content": "\ud800"}], 400),  # a lone surrogate, as a JSON escape
        ([{"role": "assistant", "content": "x", "tool_calls": 5}], 400),  # the template fails
        ([{"role": "user", "content": "a", "tool_calls": [{"function": "not an object"}]}], 200),
    ],
    ids=["surrogate", "template", "odd-tool-call"],
)
def test_messages_the_template_or_tokenizer_cannot_take_are_not_a_500(
    tokenizer: Any, messages: list[dict[str, Any]], status: int
) -> None:
    """A 400 when the template or the tokenizer cannot take them; when they can, comparing
    them on the next request is no 500 either."""
    engine = EmbeddingEngine(tokenizer)
    endpoint, app = _endpoint_app(tokenizer, engine)
    ticket = endpoint.open()
    path = f"/t/{ticket.id}/v1/chat/completions"
    body = json.dumps({"model": "policy", "messages": messages}, ensure_ascii=True)
    with TestClient(app, client=("127.0.0.1", 5000), raise_server_exceptions=False) as client:
        reply = client.post(path, content=body, headers=_bearer(ticket.key))
        assert reply.status_code == status, reply.text[:300]
        if status == 200:
            follow = [*messages, reply.json()["choices"][0]["message"]]
            follow.append({"role": "user", "content": "more"})
            again = client.post(
                path,
                content=json.dumps({"model": "policy", "messages": follow}),
                headers=_bearer(ticket.key),
            )
            assert again.status_code == 200, again.text[:300]
    trajectory = endpoint.take(ticket.id)
    assert trajectory is not None
    assert trajectory.requests == (0 if status == 400 else 2)
    assert len(engine.contexts) == trajectory.requests


@contextlib.contextmanager
def _posting(
    tokenizer: Any, headers: dict[str, str]
) -> Iterator[tuple[EmbeddingEngine, EndpointServer, http.client.HTTPConnection]]:
    """A ``POST /v1/completions`` to a served endpoint (bodies up to 4096 bytes) with its
    bearer and ``headers`` sent: the test writes the body (or not) and reads the answer."""
    engine = EmbeddingEngine(tokenizer)
    endpoint, _ = _endpoint_app(tokenizer, engine)
    server = EndpointServer(endpoint, max_body_bytes=4096)
    try:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Authorization", f"Bearer {server.token}")
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        yield engine, server, connection
    finally:
        server.close()


def test_a_chunked_body_over_the_limit_is_refused_while_it_is_read(tokenizer: Any) -> None:
    """A chunked body was buffered whole before its size was checked; now the server answers
    413 as soon as it passes the limit, without waiting for (or reading) the rest."""
    chunked = {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    with _posting(tokenizer, chunked) as (engine, server, connection):
        chunk = b'{"model": "policy", "prompt": "' + b"x" * 6000
        connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        # the body never ends: the answer must come anyway
        started = time.monotonic()
        reply = connection.getresponse()
        assert reply.status == 413
        assert "4096 bytes" in json.loads(reply.read())["error"]["message"]
        assert time.monotonic() - started < 5
        connection.close()
        again = http.client.HTTPConnection(server.host, server.port, timeout=10)
        again.request("GET", "/v1/models", headers={"Authorization": f"Bearer {server.token}"})
        assert again.getresponse().status == 200  # and the server goes on
        again.close()
    assert engine.contexts == []


def test_a_declared_length_over_the_limit_is_refused_before_the_body(tokenizer: Any) -> None:
    with _posting(tokenizer, {"Content-Length": str(1 << 30)}) as (_, _, connection):
        connection.send(b"{")
        reply = connection.getresponse()
        assert reply.status == 413
        connection.close()


class GatedEngine(EmbeddingEngine):
    """Fails its first call; blocks its second until released."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.started, self.release = threading.Event(), threading.Event()

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        if not self.contexts:
            self.contexts.append([])
            raise RuntimeError("the engine failed")
        self.started.set()
        assert self.release.wait(30)
        return super().generate(prompts, params)


def test_a_request_changes_its_trajectory_only_once_the_engine_answered(tokenizer: Any) -> None:
    """An engine failure leaves the trajectory as it was (the agent may ask again), and a run
    that ended while the engine sampled gets nothing recorded (409)."""
    engine = GatedEngine(tokenizer)
    endpoint, app = _endpoint_app(tokenizer, engine)
    ticket = endpoint.open()
    path, headers = f"/t/{ticket.id}/v1/chat/completions", _bearer(ticket.key)
    trajectory = endpoint.trajectories[ticket.id]
    with TestClient(app, client=("127.0.0.1", 5000), raise_server_exceptions=False) as client:
        failed = client.post(path, json=GOOD, headers=headers)
        assert failed.status_code == 500
        assert (trajectory.prompt, trajectory.messages, trajectory.requests) == ([], [], 0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.post, path, json=GOOD, headers=headers)
            assert engine.started.wait(30)
            endpoint.finish(ticket.id)  # the agent run timed out meanwhile
            engine.release.set()
            late = pending.result(timeout=30)
    assert late.status_code == 409, late.text
    assert (trajectory.prompt, trajectory.tokens, trajectory.requests) == ([], [], 0)
    assert len(engine.contexts) == 2  # the engine did sample: nothing of it was kept


def test_workers_give_the_endpoint_the_models_positions(tokenizer: Any, tmp_path: Any) -> None:
    """build_agent_loop (what every rollout worker runs) bounds contexts by what the rollout
    can hold: here the model's positions, read from the recipe's model folder."""
    from hf_core.config import TrainerConfig
    from hf_core.config.layout import resolve_layout
    from hf_core.roles.common import build_agent_loop

    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "max_position_embeddings": 48})
    )
    config = TrainerConfig.model_validate(
        {
            "model": {"path": str(tmp_path)},
            "reward": {"function": "digits_reverse"},
            "agent": {"function": f"{__name__}:long_prompt_agent", "max_total_tokens": 64},
        }
    )
    generation = resolve_layout(config).generation
    loop = build_agent_loop(config, generation, EmbeddingEngine(tokenizer))  # type: ignore[arg-type]
    try:
        assert isinstance(loop, FunctionAgentLoop)
        assert loop.endpoint.limits.capacity == 48
    finally:
        loop.close()
