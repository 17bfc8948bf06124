"""Agent code written for the openai client, on the real engine pair: the transformers engine
serves the policy endpoint, the FSDP engine recomputes log-probs on what was recorded.

Two conversations run concurrently, each asking, getting a tool message back and asking again,
through the real ``openai`` package.  Each trajectory must be the engine's sampled ids with the
chat template's tokens for the inserted messages between them, and the rollout log-prob of
every sampled token must equal the training engine's within 1e-4 (float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from hf_core.agents.config import AgentConfig
from hf_core.agents.function_agents import FunctionAgentLoop
from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_core.engines.decoding import left_padded, strip_left_padding
from hf_fsdp.engine import FSDPEngine
from hf_fsdp.rollout import TransformersRolloutEngine

pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {}
"""Each agent run's final messages, by its prompt."""


async def ask_twice(client: Any, sample: dict[str, Any]) -> float:
    """Ask, answer whatever came back with a tool message, ask again."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample["prompt"]}]
    first = await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=6
    )
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    calls = message.tool_calls or []
    call_id = calls[0].id if calls else "0"
    messages.append({"role": "tool", "tool_call_id": call_id, "content": "42"})
    await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=6
    )
    CONVERSATIONS[sample["prompt"]] = messages
    return 1.0


class Recording:
    """The rollout engine, with every call's contexts and sampled ids kept."""

    def __init__(self, engine: TransformersRolloutEngine) -> None:
        self.engine = engine
        self.sampled: dict[tuple[int, ...], list[int]] = {}

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        out = self.engine.generate(prompts, params)
        contexts = strip_left_padding(prompts["input_ids"], prompts["attention_mask"])
        mask = out["response_mask"].bool()
        for row, context in enumerate(contexts):
            self.sampled[tuple(context)] = out["responses"][row][mask[row]].tolist()
        return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_testing.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("endpoint") / "m"
    return build_tiny_model(folder, vocab_size=256, tool_calls=True, chat_template=True)


def test_two_concurrent_agents_give_token_exact_trajectories(model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    engine = Recording(
        TransformersRolloutEngine({"model_path": str(model), "seed": 5, "dtype": "float32"})
    )
    config = AgentConfig(function=f"{__name__}:ask_twice", max_turns=2, max_total_tokens=64)
    loop = FunctionAgentLoop(engine, tokenizer, config)  # type: ignore[arg-type]
    questions = ["12*34=", "reverse 987:"]
    try:
        rows = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
        params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
        batch = loop.generate(left_padded(rows, tokenizer.pad_token_id), params)
    finally:
        loop.close()
    assert batch["agent_reward"].tolist() == [1.0, 1.0]
    assert batch["agent_turns"].tolist() == [2, 2]

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    width = batch["prompts"].shape[1]
    prompts = strip_left_padding(batch["prompts"], batch["attention_mask"][:, :width])
    for row, question in enumerate(questions):
        messages = CONVERSATIONS[question]
        prompt = encode(
            tokenizer.apply_chat_template(
                messages[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True
            )
        )
        assert prompts[row] == prompt
        first = engine.sampled[tuple(prompt)]
        before = tokenizer.apply_chat_template(messages[:2], tools=TOOLS, tokenize=False)
        after = tokenizer.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        stop = tokenizer.eos_token  # the turn's end: sampled, or closed by the template
        closed = bool(first) and first[-1] == tokenizer.eos_token_id
        glue = ("" if closed else stop) + before.rsplit(stop, 1)[1]
        inserted = encode(glue + after[len(before) :])
        second = engine.sampled[tuple(prompt + first + inserted)]
        length = len(first) + len(inserted) + len(second)
        assert batch["responses"][row, :length].tolist() == first + inserted + second
        sampled = [1] * len(first) + [0] * len(inserted) + [1] * len(second)
        assert batch["response_mask"][row, :length].tolist() == sampled
        assert int(batch["response_mask"][row].sum()) == len(first) + len(second)

    trainer = FSDPEngine({"model_path": str(model), "trainable": False})
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    trained = trainer.compute_log_probs(batch.select(*keys), temperature=1.0)["log_probs"]
    mask = batch["response_mask"].bool()
    gap = (trained - batch["rollout_log_probs"]).abs()[mask]
    assert gap.numel() > 0 and float(gap.max()) <= 1e-4, float(gap.max())
    assert not batch["rollout_log_probs"][~mask].any()  # inserted tokens carry no log-prob
