"""The README demo: build a tiny model and a digit-reversal task locally, then run GRPO.

    python recipes/demo.py [key=value ...]        # e.g. run.total_steps=10

Everything is made here, deterministically (no model hub): a random-weight tiny Qwen2 with a
locally trained tokenizer, and JSONL files of "reverse 12345:" -> "54321" prompts.  A short
supervised warm start (sft.steps) gives the policy a foothold; GRPO then improves the reward
(partial credit per correct digit).  The summary compares the mean reward of the first and the
last 10% of RL steps.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer
from hf_testing.tasks import write_digit_task
from hf_testing.tiny import build_tiny_model

RECIPE = Path(__file__).with_name("demo.yaml")
REQUIRED_GAIN = 0.2
HEADS = {"vllm": (2, 1)}
"""(attention heads, KV heads) of the demo model per rollout backend, where the default (4, 2:
head_dim 16) does not run: vLLM's CPU attention kernels reject head_dim 16 ("Unsupported CPU
attention configuration"), so a vLLM rollout gets heads of 32 (same hidden size)."""


def build_assets(folder: Path, rollout_backend: str = "transformers") -> dict[str, str]:
    """Model, tokenizer and task files (rebuilt identically every time)."""
    heads, kv_heads = HEADS.get(rollout_backend, (4, 2))
    model = build_tiny_model(
        folder / "model",
        family="qwen2",
        hidden_size=64,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
    )
    train = write_digit_task(
        folder / "train.jsonl", "reverse", n=2000, min_len=3, max_len=5, seed=0
    )
    val = write_digit_task(folder / "val.jsonl", "reverse", n=64, min_len=3, max_len=5, seed=1)
    return {
        "model.path": str(model),
        "data.train_files": f"[{train}]",
        "data.val_files": f"[{val}]",
    }


def main(argv: list[str]) -> int:
    # A single-machine demo: no need for Ray's cluster token in the home folder.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    probe = load_config(TrainerConfig, RECIPE, ["model.path=unset", *argv])
    assets = build_assets(Path(probe.run.output_dir) / "assets", probe.rollout.backend)
    overrides = [f"{key}={value}" for key, value in assets.items()] + argv
    config = load_config(TrainerConfig, RECIPE, overrides)
    summary = RLTrainer(config).fit()
    learning = summary.learning
    if learning is None:
        print("no reward was logged")
        return 1
    verdict = "learned" if learning.delta >= REQUIRED_GAIN else "did not learn enough"
    print(f"demo: {learning} -> {verdict} (needs +{REQUIRED_GAIN}); plot: {summary.plot_path}")
    return 0 if learning.delta >= REQUIRED_GAIN else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
