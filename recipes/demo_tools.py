"""The agent demo: a tiny model learns to call the calculator (multi-turn GRPO).

    python recipes/demo_tools.py [key=value ...]        # e.g. run.total_steps=10

Everything is made here, deterministically: a random-weight tiny Qwen2 whose tokenizer can
write Hermes tool calls, and "23*45=" -> "1035" prompts.  The supervised warm start shows the
format on examples of which 30% call the calculator and the rest answer directly (guessing); GRPO
then raises the reward, which only a tool call earns, and the tool calls per sample with it.
The summary compares the first and last 10% of RL steps for both.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer
from hf_testing.tiny import build_tiny_model
from hf_testing.tool_task import write_calculator_task

RECIPE = Path(__file__).with_name("demo_tools.yaml")
REQUIRED_GAIN = 0.2


def build_assets(folder: Path) -> dict[str, str]:
    """Model, tokenizer and task file (rebuilt identically every time)."""
    model = build_tiny_model(
        folder / "model",
        family="qwen2",
        hidden_size=128,
        num_layers=2,
        vocab_size=256,
        tool_calls=True,
    )
    train = write_calculator_task(folder / "train.jsonl", n=4000, seed=0, tool_fraction=0.3)
    return {"model.path": str(model), "data.train_files": f"[{train}]"}


def first_last(path: Path, key: str) -> tuple[float, float]:
    """Mean of ``key`` over the first and the last 10% of logged steps."""
    rows = [json.loads(line) for line in path.open()]
    values = [row[key] for row in rows if key in row]
    tenth = max(1, len(values) // 10)
    return sum(values[:tenth]) / tenth, sum(values[-tenth:]) / tenth


def run_tool_demo(
    name: str, recipe: Path, build: Callable[[Path], dict[str, str]], argv: list[str]
) -> int:
    """Build the assets, train ``recipe`` with ``argv`` on top, and judge it: the reward must
    gain ``REQUIRED_GAIN`` and the tool calls per sample must rise (first vs last 10% of RL
    steps).  Failed agent runs are reported where the run logs them (``agent.function``)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    probe = load_config(TrainerConfig, recipe, ["model.path=unset", *argv])
    assets = build(Path(probe.run.output_dir) / "assets")
    overrides = [f"{key}={value}" for key, value in assets.items()] + argv
    config = load_config(TrainerConfig, recipe, overrides)
    RLTrainer(config).fit()
    metrics = config.run.output_dir / "metrics.jsonl"
    r0, r1 = first_last(metrics, "reward/mean")
    c0, c1 = first_last(metrics, "agent/tool_calls_mean")
    learned = r1 - r0 >= REQUIRED_GAIN and c1 > c0
    failures = ""
    if config.agent is not None and config.agent.function is not None:
        failed = first_last(metrics, "agent/failed")[1] + first_last(metrics, "agent/timed_out")[1]
        failures = f", failed agent runs per step at the end {failed:.1f}"
    print(
        f"{name}: reward {r0:.3f} -> {r1:.3f} (needs +{REQUIRED_GAIN}), tool calls per "
        f"sample {c0:.2f} -> {c1:.2f}{failures}: "
        f"{'learned' if learned else 'did not learn enough'}"
    )
    return 0 if learned else 1


def main(argv: list[str]) -> int:
    return run_tool_demo("demo_tools", RECIPE, build_assets, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
