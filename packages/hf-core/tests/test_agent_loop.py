"""The agent loop over a scripted rollout engine (a fake engine, for core's fast unit tests):
turns, tool messages with loss mask 0, malformed calls, limits, environments, metrics.

The log-prob parity of multi-turn samples with a real engine pair is tested in hf-fsdp."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from hf_core.agents.config import AgentConfig
from hf_core.agents.loop import AgentLoop, agent_metrics
from hf_core.batch import Batch
from hf_core.engines import NamedTensor, RolloutEngine, SamplingParams, assemble_rollout
from hf_core.engines.decoding import pack_responses, strip_left_padding
from hf_core.plugins.tools import resolve_tools
from hf_core.tool_calls import format_tool_call
from hf_testing.scripted_routing import add_scripted_routing, assert_first_routing

TEMPLATE = "\n<tool_response>{result}</tool_response>\n"


class ScriptedEngine(RolloutEngine):
    """Answers each context with ``script(context_text)`` + EOS; log-prob of token k is
    ``-(k + 1) / 100``.  Records the contexts of every call."""

    def __init__(self, tokenizer: Any, script: Callable[[str], str]) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.calls: list[list[str]] = []

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        contexts = strip_left_padding(prompts["input_ids"], prompts["attention_mask"])
        texts = [self.tokenizer.decode(c) for c in contexts]
        self.calls.append(texts)
        tokens, log_probs = [], []
        for text in texts:
            ids = self.tokenizer(self.script(text), add_special_tokens=False)["input_ids"]
            ids = [*ids, self.tokenizer.eos_token_id][: params.max_new_tokens]
            tokens.append(ids)
            log_probs.append([-(k + 1) / 100 for k in range(len(ids))])
        responses, lp, mask = pack_responses(
            tokens, log_probs, params.max_new_tokens, self.tokenizer.pad_token_id, torch.long
        )
        return assemble_rollout(prompts, responses, mask, lp, params.temperature)

    def load_weights(self, bucket: Iterable[NamedTensor]) -> None:
        pass


CALL = format_tool_call("calculator", {"expression": "12*34"})


def script(context: str) -> str:
    """Prompt A calls the calculator then answers; B answers at once; C writes a malformed
    call, then a good one, then answers."""
    if context.startswith("A"):
        return "408" if "<tool_response>" in context else CALL
    if context.startswith("B"):
        return "7"
    responses = context.count("<tool_response>")
    return ["<tool_call>{oops</tool_call>", CALL, "408"][responses]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from hf_testing.tiny import build_tokenizer

    return build_tokenizer(256, tool_calls=True)


def prompts(tokenizer: Any, texts: list[str]) -> Batch:
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return Batch({"input_ids": ids, "attention_mask": mask})


def run(tokenizer: Any, texts: list[str], **config: Any) -> tuple[Batch, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, script)
    settings = {"tool_response_template": TEMPLATE, "max_total_tokens": 200, **config}
    agent = AgentConfig(**settings)
    loop = AgentLoop(engine, tokenizer, agent, resolve_tools(agent.tools))
    params = SamplingParams(max_new_tokens=64, n=config.pop("n", 1) if "n" in config else 1)
    return loop.generate(prompts(tokenizer, texts), params), engine


def split(tokenizer: Any, batch: Batch, row: int) -> tuple[str, str]:
    """(model text, tool text) of one sample, from the masks."""
    ids, model = batch["responses"][row], batch["response_mask"][row].bool()
    width = ids.shape[0]
    attended = batch["attention_mask"][row, -width:].bool()
    return tokenizer.decode(ids[model]), tokenizer.decode(ids[attended & ~model])


def test_turns_tool_messages_and_masks(tokenizer: Any) -> None:
    batch, engine = run(tokenizer, ["A: 12*34=", "B: 3+4=", "C: 12*34="])
    eos = tokenizer.eos_token
    assert split(tokenizer, batch, 0) == (f"{CALL}{eos}408{eos}", TEMPLATE.format(result="408"))
    assert split(tokenizer, batch, 1) == (f"7{eos}", "")
    model_c, tool_c = split(tokenizer, batch, 2)
    assert model_c == f"<tool_call>{{oops</tool_call>{eos}{CALL}{eos}408{eos}"
    assert "error: the tool call is not valid JSON" in tool_c and "408" in tool_c
    # Finished samples leave the batch; the others go on together, one engine call a round.
    assert [len(c) for c in engine.calls] == [3, 2, 1]
    # Rollout log-probs: the engine's on model tokens, 0 on tool and padding tokens.
    mask = batch["response_mask"].bool()
    assert (batch["rollout_log_probs"][~mask] == 0).all()
    assert batch["rollout_log_probs"][1, 0].item() == pytest.approx(-0.01)
    assert batch["agent_turns"].tolist() == [2, 1, 3]
    assert batch["agent_tool_calls"].tolist() == [1, 0, 2]
    assert batch["agent_tool_errors"].tolist() == [0, 0, 1]
    call = {"name": "calculator", "arguments": {"expression": "12*34"}}
    assert batch["tool_calls"][0] == [{**call, "result": "408", "status": "ok"}]
    assert "<tool_response>408</tool_response>" in batch["trajectory"][0]
    # The trainer's keys: prompt + response lined up, positions over attended tokens.
    width = batch["responses"].shape[1]
    assert torch.equal(batch["input_ids"][:, -width:], batch["responses"])
    assert torch.equal(batch["position_ids"], (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    metrics = agent_metrics(batch)
    assert metrics["agent/turns_mean"] == pytest.approx(2.0)
    assert metrics["agent/tool_calls_mean"] == pytest.approx(1.0)
    tool_tokens = (batch["attention_mask"][:, -width:].sum() - mask.sum()).item()
    assert metrics["agent/tool_tokens_mean"] == pytest.approx(tool_tokens / 3) and tool_tokens > 0


def test_turn_and_token_limits(tokenizer: Any) -> None:
    one_turn, _ = run(tokenizer, ["A: 12*34=", "C: 12*34="], max_turns=1)
    assert one_turn["agent_turns"].tolist() == [1, 1]
    assert int(one_turn["agent_tool_calls"].sum()) == 0  # the last turn's calls go unanswered
    short, _ = run(tokenizer, ["A: 12*34=", "C: 12*34="], max_total_tokens=40)
    width = short["responses"].shape[1]
    assert width == 40
    assert (short["attention_mask"][:, -width:].sum(-1) <= 40).all()


def test_n_samples_per_prompt_and_unknown_tools(tokenizer: Any) -> None:
    def unknown(context: str) -> str:
        if "<tool_response>" in context:
            return "done"
        return format_tool_call("search", {"q": "x"})

    engine = ScriptedEngine(tokenizer, unknown)
    agent = AgentConfig(tool_response_template=TEMPLATE)
    loop = AgentLoop(engine, tokenizer, agent, resolve_tools(agent.tools))
    batch = loop.generate(prompts(tokenizer, ["A", "B"]), SamplingParams(n=2, max_new_tokens=64))
    assert len(batch) == 4 and batch["agent_tool_errors"].tolist() == [1, 1, 1, 1]
    assert "no tool 'search'; tools: calculator" in batch["trajectory"][0]


class Countdown:
    """An environment that answers each turn with the number of turns left, then stops."""

    def reset(self, prompt: str) -> None:
        self.left = 2

    def step(self, turn_text: str) -> str | None:
        if self.left == 0:
            return None
        self.left -= 1
        return f"left {self.left}"


def test_a_per_sample_environment_answers_turns(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, lambda context: "7")
    config = AgentConfig(tool_response_template=TEMPLATE, environment=f"{__name__}:Countdown")
    batch = AgentLoop(engine, tokenizer, config, resolve_tools(config.tools)).generate(
        prompts(tokenizer, ["B", "B"]), SamplingParams(max_new_tokens=8)
    )
    assert batch["agent_turns"].tolist() == [3, 3]
    assert "left 1" in batch["trajectory"][0] and "left 0" in batch["trajectory"][0]


def test_sft_targets_with_tool_segments(tokenizer: Any) -> None:
    from hf_core.trainer.batches import sft_batch

    eos = tokenizer.eos_token
    target = [
        {"text": CALL + eos},
        {"text": TEMPLATE.format(result="408"), "train": False},
        {"text": "408" + eos},
    ]
    batch = prompts(tokenizer, ["A: 12*34=", "B: 3+4="])
    batch["sft_target"] = [target, "7"]
    sft = sft_batch(batch, tokenizer, "sft_target")
    pieces = [tokenizer(s["text"], add_special_tokens=False)["input_ids"] for s in target]
    ids = [t for piece in pieces for t in piece]
    assert sft["responses"][0, : len(ids)].tolist() == ids
    mask = [1] * len(pieces[0]) + [0] * len(pieces[1]) + [1] * len(pieces[2])
    assert sft["response_mask"][0, : len(ids)].tolist() == mask
    width = sft["responses"].shape[1]
    assert int(sft["attention_mask"][0, -width:].sum()) == len(ids)  # tool text is attended
    seven = tokenizer("7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert sft["responses"][1, : len(seven)].tolist() == seven
    assert int(sft["response_mask"][1].sum()) == len(seven)


def test_hanging_and_memory_hungry_python_calls_are_stopped_and_the_rollout_goes_on(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_core.agents import tools as tools_mod

    limits = tools_mod.PYTHON_LIMITS.model_copy(
        update={"cpu_seconds": 1, "wall_seconds": 1.5, "memory_mb": 128}
    )
    monkeypatch.setattr(tools_mod, "PYTHON_LIMITS", limits)
    code = {"S": "import time\ntime.sleep(60)", "H": "while True:\n    pass"}
    code["M"] = "x = bytearray(2**33)\nprint(len(x))"

    def script(context: str) -> str:
        if "<tool_response>" in context:
            return "done"
        return format_tool_call("python", {"code": code[context[0]]})

    engine = ScriptedEngine(tokenizer, script)
    config = AgentConfig(tools=["python"], tool_response_template=TEMPLATE)
    batch = AgentLoop(engine, tokenizer, config, resolve_tools(config.tools)).generate(
        prompts(tokenizer, ["S", "H", "M"]), SamplingParams(max_new_tokens=64)
    )
    statuses = [[c["status"] for c in calls] for calls in batch["tool_calls"]]
    assert statuses == [["timeout"], ["timeout"], ["error"]]
    assert "MemoryError" in batch["tool_calls"][2][0]["result"]
    assert batch["agent_turns"].tolist() == [2, 2, 2]  # each sample answered after its tool
    assert agent_metrics(batch)["agent/tool_timeouts_mean"] == pytest.approx(2 / 3)


async def slow_tool() -> str:
    """Answers after a while (the test of continuous batching)."""
    await asyncio.sleep(1.0)
    return "slow answer"


async def fast_tool() -> str:
    return "fast answer"


class SlowEngine(ScriptedEngine):
    """Takes a while per call, as a real engine does, so tools finish during generations."""

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        time.sleep(0.3)
        return super().generate(prompts, params)


def _chain(context: str) -> str:
    """A calls the slow tool once; B calls the fast tool six times; both then answer."""
    answers = context.count("<tool_response>")
    if context.startswith("A"):
        return "done" if answers else format_tool_call("slow_tool", {})
    return "done" if answers >= 6 else format_tool_call("fast_tool", {})


@pytest.mark.parametrize("continuous", [False, True])
def test_continuous_batches_mix_turns(tokenizer: Any, continuous: bool) -> None:
    engine = SlowEngine(tokenizer, _chain)
    config = AgentConfig(
        tools=[f"{__name__}:fast_tool", f"{__name__}:slow_tool"],
        tool_response_template=TEMPLATE,
        max_turns=8,
        continuous=continuous,
    )
    batch = AgentLoop(engine, tokenizer, config, resolve_tools(config.tools)).generate(
        prompts(tokenizer, ["A", "B"]), SamplingParams(max_new_tokens=64)
    )
    assert batch["agent_turns"].tolist() == [2, 7]
    assert batch["agent_tool_calls"].tolist() == [1, 6]
    assert "slow answer" in batch["trajectory"][0]
    turns = [sorted(c.count("<tool_response>") for c in call) for call in engine.calls]
    mixed = [t for t in turns if len(set(t)) > 1]
    if continuous:  # B went on while A's tool ran; A came back next to B at a later turn
        assert mixed and turns[1] == [1], turns
    else:  # rounds: everyone waits for the slow tool, each call holds one turn
        assert not mixed and turns[1] == [1, 1]


def test_rewards_see_the_whole_trajectory(tokenizer: Any) -> None:
    from hf_core.rewards import RuleReward

    def used_the_tool(
        responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
    ) -> list[float]:
        return [
            float(any(c["status"] == "ok" and c["result"] == t for c in calls) and "408" in text)
            for calls, t, text in zip(
                extras["tool_calls"], ground_truths, extras["trajectory"], strict=True
            )
        ]

    batch, _ = run(tokenizer, ["A: 12*34=", "B: 3+4=", "C: 12*34="])
    batch["ground_truth"] = ["408", "7", "408"]
    scores = RuleReward(used_the_tool, tokenizer)(batch)
    assert scores.tolist() == [1.0, 0.0, 1.0]
    # The response text itself is the model's own tokens only (no tool message in it).
    assert RuleReward(used_the_tool, tokenizer).decode(batch)[0] == CALL + "408"


class RoutingEngine(ScriptedEngine):
    """A scripted engine of a mixture of experts (:mod:`hf_testing.scripted_routing`)."""

    def __init__(self, tokenizer: Any, script: Callable[[str], str]) -> None:
        super().__init__(tokenizer, script)
        self.fed: list[list[list[int]]] = []  # per call, per row: the fed tokens

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        out = super().generate(prompts, params)
        self.fed.append(add_scripted_routing(out, call=len(self.calls) - 1))
        if not params.routed_experts:
            out.pop("routed_experts")
        return out


def test_agent_samples_carry_the_experts_of_the_first_turn_that_fed_each_token(
    tokenizer: Any,
) -> None:
    engine = RoutingEngine(tokenizer, script)
    agent = AgentConfig(tool_response_template=TEMPLATE, max_total_tokens=200)
    loop = AgentLoop(engine, tokenizer, agent, resolve_tools(agent.tools))
    params = SamplingParams(max_new_tokens=64, routed_experts=True)
    batch = loop.generate(prompts(tokenizer, ["A: 12*34=", "B: 3+4=", "C: 12*34="]), params)
    assert batch["routed_experts"].shape[:2] == batch["input_ids"].shape
    # A and C take several turns (later ones re-fed the context), B one
    assert [assert_first_routing(batch, row, engine.fed) > 0 for row in range(3)] == [
        True,
        False,
        True,
    ]
    without, _ = run(tokenizer, ["A: 12*34="])
    assert "routed_experts" not in without
