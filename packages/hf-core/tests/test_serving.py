"""The OpenAI-compatible policy endpoint on a scripted engine: token-exact trajectories through
the real ``openai`` client, the HTTP checks, and agent functions that fail.

The engine here is scripted (it answers a tool call, then the tool's result), so every token
the endpoint records can be predicted; tests/e2e/test_agent_endpoint.py runs the real engines.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_core.agents.config import AgentConfig
from hf_core.agents.function_agents import AgentResult, FunctionAgentLoop
from hf_core.batch import Batch
from hf_core.engines.decoding import strip_left_padding
from hf_core.engines.rollout import SamplingParams, assemble_rollout
from hf_core.serving import (
    ChatRenderer,
    EndpointLimits,
    EndpointServer,
    EngineBatcher,
    PolicyEndpoint,
)
from hf_testing.scripted_routing import add_scripted_routing, assert_first_routing
from hf_testing.tiny import CHAT_TEMPLATE, build_tokenizer

openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = build_tokenizer(vocab_size=256, tool_calls=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


class ScriptedEngine:
    """Calls the calculator on a first turn, answers with the tool's result after it; every
    sampled token's log-prob is -0.01 * (its position in the completion + 1)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[int] = []
        """Rows per generate call."""
        self.sampled: list[list[int]] = []

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        rows = strip_left_padding(prompts["input_ids"], prompts["attention_mask"])
        self.calls.append(len(rows))
        outs = []
        for row in rows:
            text = self.tokenizer.decode(row)
            if "<tool_response>" in text:
                answer = text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]
            else:
                expression = text.rsplit("user\n", 1)[1].split("=", 1)[0]
                call = {"name": "calculator", "arguments": {"expression": expression}}
                answer = f"<tool_call>{json.dumps(call)}</tool_call>"
            ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
            ids = [*ids, self.tokenizer.eos_token_id][: params.max_new_tokens]
            self.sampled.append(ids)
            outs.append(ids)
        width = max(len(o) for o in outs)
        responses = torch.zeros(len(outs), width, dtype=torch.long)
        mask = torch.zeros(len(outs), width, dtype=torch.long)
        log_probs = torch.zeros(len(outs), width)
        for i, ids in enumerate(outs):
            responses[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
            log_probs[i, : len(ids)] = -0.01 * torch.arange(1, len(ids) + 1)
        return assemble_rollout(prompts, responses, mask, log_probs, params.temperature)


def _endpoint(
    tokenizer: Any, engine: ScriptedEngine, limits: EndpointLimits | None = None, **options: Any
) -> PolicyEndpoint:
    """An endpoint on ``engine`` at policy version 7, 64 new tokens a completion; ``limits``
    (default: four requests a trajectory) and ``options`` as :class:`PolicyEndpoint` takes
    them.  test_serving_inputs builds its endpoints here too."""
    batcher = EngineBatcher(engine, tokenizer.pad_token_id, version=lambda: 7)  # type: ignore[arg-type]
    renderer = ChatRenderer(tokenizer, [tokenizer.eos_token_id])
    limits = limits or EndpointLimits(max_requests=4)
    return PolicyEndpoint(batcher, renderer, SamplingParams(max_new_tokens=64), limits, **options)


async def _calculator_agent(client: Any, question: str) -> str:
    """What agent code written for the chat API does: ask, run the tool, ask again."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        expression = json.loads(call.function.arguments)["expression"]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    return str(second.choices[0].message.content)


def test_concurrent_conversations_are_token_exact(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the two agents' requests must meet in the batcher's gathering window: its 10 ms is
    # shorter than a busy test machine's scheduling delay between the two coroutines' requests
    monkeypatch.setattr("hf_core.serving.batching.GATHER_WINDOW_S", 1.0)
    engine = ScriptedEngine(tokenizer)
    endpoint = _endpoint(tokenizer, engine)
    server = EndpointServer(endpoint)
    tickets = {"a": endpoint.open(), "b": endpoint.open()}
    try:

        async def both() -> list[str]:
            async with server.client(tickets["a"]) as a, server.client(tickets["b"]) as b:
                return list(
                    await asyncio.gather(
                        _calculator_agent(a, "12*34="), _calculator_agent(b, "56*78=")
                    )
                )

        answers = asyncio.run(both())
    finally:
        server.close()
        endpoint.batcher.close()
    assert answers == ["408", "4368"]
    assert engine.calls == [2, 2]  # the two conversations shared each engine call

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    for name, question in (("a", "12*34="), ("b", "56*78=")):
        trajectory = endpoint.take(tickets[name].id)
        assert trajectory is not None
        user = [{"role": "user", "content": question}]
        rendered = tokenizer.apply_chat_template(
            user, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert trajectory.prompt == encode(rendered)
        first, second = (s for s in engine.sampled if tokenizer.decode(s) in _answers(question))
        tool_message = trajectory.messages[2]
        assert tool_message["role"] == "tool"
        # the template's text for the tool message and the next assistant opening
        full = tokenizer.apply_chat_template(
            trajectory.messages[:3], tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        before = tokenizer.apply_chat_template(trajectory.messages[:2], tools=TOOLS, tokenize=False)
        glue = before.rsplit(tokenizer.eos_token, 1)[1]
        inserted = encode(glue + full[len(before) :])
        assert trajectory.tokens == first + inserted + second
        assert trajectory.sampled == [1] * len(first) + [0] * len(inserted) + [1] * len(second)
        expected = [-0.01 * (i + 1) for i in range(len(first))]
        assert trajectory.log_probs[: len(first)] == pytest.approx(expected)
        assert set(trajectory.versions) == {7, -1}


def _answers(question: str) -> set[str]:
    """The scripted engine's two completions for ``question``, as decoded text."""
    expression = question.rstrip("=")
    call = {"name": "calculator", "arguments": {"expression": expression}}
    eos = "<|endoftext|>"
    return {f"<tool_call>{json.dumps(call)}</tool_call>{eos}", f"{eval(expression)}{eos}"}


@pytest.fixture
def served(tokenizer: Any) -> Any:
    """The app on a scripted engine, and its endpoint (to open trajectories)."""
    from hf_core.serving.app import build_app

    endpoint = _endpoint(tokenizer, ScriptedEngine(tokenizer))
    app = build_app(endpoint, token="secret", model_name="policy", max_body_bytes=2048)
    yield app, endpoint
    endpoint.batcher.close()


@pytest.fixture
def http(served: Any) -> Any:
    return served[0]


GOOD = {"model": "policy", "messages": [{"role": "user", "content": "2*3="}]}
AUTH = {"Authorization": "Bearer secret"}


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        ({}, json.dumps(GOOD), 401),
        ({"Authorization": "Bearer wrong"}, json.dumps(GOOD), 401),
        (AUTH, "{not json", 400),
        (AUTH, json.dumps({**GOOD, "model": "gpt-4"}), 404),
        (AUTH, json.dumps({**GOOD, "messages": []}), 400),
        (AUTH, json.dumps({**GOOD, "stream": True}), 400),
        (AUTH, json.dumps({**GOOD, "padding": "x" * 4096}), 413),
    ],
)
def test_bad_requests_get_the_right_4xx_and_the_endpoint_goes_on(
    served: Any, headers: dict[str, str], body: str, status: int
) -> None:
    app, endpoint = served
    x, y = endpoint.open(), endpoint.open()
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        path = f"/t/{x.id}/v1/chat/completions"
        reply = client.post(path, content=body, headers=headers)
        assert reply.status_code == status, reply.text
        assert "message" in reply.json()["error"]
        good = client.post(f"/t/{y.id}/v1/chat/completions", json=GOOD, headers=AUTH)
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_non_loopback_clients_are_refused(http: Any) -> None:
    with TestClient(http, client=("10.1.2.3", 5000)) as client:
        reply = client.post("/t/x/v1/chat/completions", json=GOOD, headers=AUTH)
    assert reply.status_code == 403


def test_an_edited_conversation_is_refused_not_retokenised(served: Any) -> None:
    app, endpoint = served
    path = f"/t/{endpoint.open().id}/v1/chat/completions"
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        first = client.post(path, json=GOOD, headers=AUTH).json()
        message = first["choices"][0]["message"]
        edited = {**message, "content": "I changed my mind"}
        follow = {
            "model": "policy",
            "messages": [*GOOD["messages"], edited, {"role": "user", "content": "and?"}],
        }
        reply = client.post(path, json=follow, headers=AUTH)
        assert reply.status_code == 400
        assert "differs" in reply.json()["error"]["message"]
        kept = {**follow, "messages": [*GOOD["messages"], message, follow["messages"][-1]]}
        assert client.post(path, json=kept, headers=AUTH).status_code == 200


# ------------------------------------------------------------ agent functions


async def good_agent(client: Any, sample: dict[str, Any]) -> float:
    return 1.0 if await _calculator_agent(client, sample["prompt"]) else 0.0


async def informative_agent(client: Any, sample: dict[str, Any]) -> AgentResult:
    answered = await _calculator_agent(client, sample["prompt"])
    return AgentResult(0.5 if answered else 0.0, {"answered": answered})


async def raising_agent(client: Any, sample: dict[str, Any]) -> float:
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "1*1="}]
    )
    raise RuntimeError("the agent crashed")


async def hanging_agent(client: Any, sample: dict[str, Any]) -> float:
    await asyncio.sleep(60)
    return 1.0


async def garbage_agent(client: Any, sample: dict[str, Any]) -> Any:
    return "a lot"


def test_failed_agent_functions_are_counted_and_masked(tokenizer: Any, tmp_path: Path) -> None:
    engine = ScriptedEngine(tokenizer)
    results = {}
    for name in ("good", "informative", "raising", "hanging", "garbage"):
        config = AgentConfig(
            function=f"test_serving:{name}_agent", timeout_s=2.0, max_turns=4, max_total_tokens=96
        )
        loop = FunctionAgentLoop(engine, tokenizer, config)  # type: ignore[arg-type]
        try:
            ids = tokenizer("3*4=", add_special_tokens=False)["input_ids"]
            prompts = Batch(
                {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids))}
            )
            results[name] = loop.generate(prompts, SamplingParams(max_new_tokens=48, n=2))
        finally:
            loop.close()
    good = results["good"]
    assert good["agent_reward"].tolist() == [1.0, 1.0]
    assert int(good["response_mask"].sum()) > 0 and good["agent_tool_calls"].tolist() == [1, 1]
    assert good["agent_info"].tolist() == [{}, {}]
    informative = results["informative"]  # an AgentResult: its reward, its info kept
    assert informative["agent_reward"].tolist() == [0.5, 0.5]
    assert informative["agent_info"].tolist() == [{"answered": "12"}, {"answered": "12"}]
    for name, flag in (("raising", "agent_failed"), ("hanging", "agent_timed_out")):
        batch = results[name]
        assert batch[flag].tolist() == [True, True], name
        assert int(batch["response_mask"].sum()) == 0, f"{name}: failed samples are trained on"
        assert batch["agent_reward"].tolist() == [0.0, 0.0]
    assert results["garbage"]["agent_failed"].tolist() == [True, True]
    assert "not a reward" in results["garbage"]["agent_error"][0]
    assert "crashed" in results["raising"]["agent_error"][0]


class RoutingEngine(ScriptedEngine):
    """The scripted engine as a mixture of experts (:mod:`hf_testing.scripted_routing`)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.fed: list[list[list[int]]] = []  # per call, per row: the fed tokens

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        out = super().generate(prompts, params)
        self.fed.append(add_scripted_routing(out, call=len(self.calls) - 1, layers=1))
        if not params.routed_experts:
            out.pop("routed_experts")
        return out


def test_agent_function_samples_carry_the_experts_of_the_first_request_that_fed_each_token(
    tokenizer: Any,
) -> None:
    engine = RoutingEngine(tokenizer)
    config = AgentConfig(function="test_serving:good_agent", max_turns=4, max_total_tokens=96)
    loop = FunctionAgentLoop(engine, tokenizer, config)  # type: ignore[arg-type]
    try:
        ids = tokenizer("3*4=", add_special_tokens=False)["input_ids"]
        prompts = Batch(
            {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids))}
        )
        batch = loop.generate(prompts, SamplingParams(max_new_tokens=48, routed_experts=True))
    finally:
        loop.close()
    assert batch["agent_reward"].tolist() == [1.0]
    assert assert_first_routing(batch, 0, engine.fed, layers=1) == 1  # two requests
