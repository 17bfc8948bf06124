"""The OpenAI-endpoint agent demo: plain openai-client agent code learns to use a calculator.

    python recipes/demo_agent_openai.py [key=value ...]   # e.g. rollout.backend=vllm

The task and warm start are demo_tools.py's (products of two-digit numbers, which only a tool
call gets right; 30% of the warm-start examples call the calculator).  The difference is the
agent: ``hf_testing.tool_task:openai_calculator_agent`` talks to the policy through the
OpenAI-compatible endpoint with the ``openai`` package, offering the calculator in the chat
API's ``tools`` parameter and running the calls itself.  Its return value is the reward.  The
summary compares the first and last 10% of RL steps: the reward must gain 0.2 and the tool
calls per sample must rise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from demo_tools import run_tool_demo
from make_assets import chat_prompt_template

from hf_testing.tiny import build_tiny_model
from hf_testing.tool_task import write_calculator_task

RECIPE = Path(__file__).with_name("demo_agent_openai.yaml")


def build_assets(folder: Path) -> dict[str, str]:
    """Model (tokenizer with a chat template), and the task with the agent's first request,
    as the chat template renders it, for prompt (rebuilt identically every time)."""
    model = build_tiny_model(
        folder / "model",
        family="qwen2",
        hidden_size=128,
        num_layers=2,
        vocab_size=256,
        tool_calls=True,
        chat_template=True,
    )
    train = write_calculator_task(
        folder / "train.jsonl",
        n=4000,
        seed=0,
        tool_fraction=0.3,
        prompt_template=chat_prompt_template(model),
    )
    return {"model.path": str(model), "data.train_files": f"[{train}]"}


def main(argv: list[str]) -> int:
    return run_tool_demo("demo_agent_openai", RECIPE, build_assets, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
