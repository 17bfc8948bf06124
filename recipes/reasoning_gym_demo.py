"""A reasoning-gym task learned by a tiny model, scored by the library's own code:

    python recipes/reasoning_gym_demo.py [key=value ...]    # recipe: recipes/reasoning_gym.yaml

Builds the README demo's tiny model locally (no model hub), then runs the recipe with
:data:`TINY_MODEL_SETTINGS`: one task, reasoning-gym's ``basic_arithmetic`` at its easiest (two
one-digit terms, + and -), the bare question as the prompt and the whole reply as the answer
(the tiny model has no chat template), a short supervised warm start on the task's own answers
(``sft.steps``), then GRPO whose only reward is the library's ``score_answer``.  The summary
compares the mean reward of the first and the last 10% of RL steps (it must gain
``REQUIRED_GAIN``) and prints the validation table per task.
Needs ``pip install 'hf-core[reasoning-gym]'``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer
from hf_testing.tiny import build_tiny_model

RECIPE = Path(__file__).with_name("reasoning_gym.yaml")
REQUIRED_GAIN = 0.2
TINY_MODEL_SETTINGS = [
    "env.tasks=null",
    "env.task=basic_arithmetic",
    "env.task_config={basic_arithmetic: {min_terms: 2, max_terms: 2, min_digits: 1, "
    "max_digits: 1, operators: ['+', '-'], allow_parentheses: false, allow_negation: false}}",
    "env.system_prompt=null",
    "env.answer=whole",
    "env.val_size=128",
    "run.output_dir=runs/reasoning_gym_demo",
    "rollout.max_new_tokens=8",
    "actor.engine.lr=1e-3",
    "reference=null",
    "algorithm.kl.mode=none",
    "sft.steps=200",
    "run.total_steps=400",
    "sft.batch_size=32",
]
"""What the tiny model needs (the command line still wins): the README demo's settings."""


def validation_table(metrics_file: Path) -> str:
    """The last validation's per-task rows (``val/env/<task>/...``)."""
    last: dict[str, float] = {}
    with metrics_file.open() as f:
        for line in f:
            row = json.loads(line)
            if any(key.startswith("val/env/") for key in row):
                last = {k: v for k, v in row.items() if k.startswith("val/env/")}
    tasks = sorted({key.split("/")[2] for key in last})
    lines = [f"{'task':<20} {'reward':>7} {'success':>8} {'count':>6}"]
    for task in tasks:
        prefix = f"val/env/{task}"
        lines.append(
            f"{task:<20} {last[f'{prefix}/reward']:>7.3f} {last[f'{prefix}/success']:>8.3f} "
            f"{int(last[f'{prefix}/count']):>6}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    # A single-machine demo: no need for Ray's cluster token in the home folder.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    argv = [*TINY_MODEL_SETTINGS, *argv]
    probe = load_config(TrainerConfig, RECIPE, argv)
    model = build_tiny_model(
        Path(probe.run.output_dir) / "assets" / "model",
        hidden_size=64,
        num_layers=2,
        family="qwen2",
        num_heads=4,
        num_kv_heads=2,
    )
    config = load_config(TrainerConfig, RECIPE, [f"model.path={model}", *argv])
    summary = RLTrainer(config).fit()
    learning = summary.learning
    if learning is None:
        print("no reward was logged")
        return 1
    print(validation_table(Path(config.run.output_dir) / "metrics.jsonl"))
    verdict = "learned" if learning.delta >= REQUIRED_GAIN else "did not learn enough"
    print(f"reasoning-gym demo: {learning} -> {verdict} (needs +{REQUIRED_GAIN})")
    return 0 if learning.delta >= REQUIRED_GAIN else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
