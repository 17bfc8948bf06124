"""Build the tiny local models and the digit tasks the recipes point at (no model hub needed).

    python recipes/make_assets.py [runs/assets]

Creates ``policy/`` (causal LM), ``teacher/`` (another causal LM, for distillation),
``critic/`` (value head), ``reward/`` and ``cost/`` (score heads), all sharing one locally
trained tokenizer, plus ``train.jsonl`` / ``val.jsonl`` of the
digit-reversal task.  Deterministic: the same files every time.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hf_testing.tasks import write_digit_task
from hf_testing.tiny import build_tiny_model

DEFAULT = Path("runs/assets")


def make_assets(folder: Path = DEFAULT) -> Path:
    # head_dim 32: vLLM's CPU attention kernels need at least that
    build_tiny_model(folder / "policy", family="qwen2", hidden_size=128, num_layers=2, seed=0)
    build_tiny_model(folder / "teacher", family="llama", hidden_size=64, num_layers=2, seed=4)
    build_tiny_model(
        folder / "critic", family="qwen2", head="value", hidden_size=64, num_layers=2, seed=1
    )
    build_tiny_model(
        folder / "reward", family="llama", head="score", hidden_size=64, num_layers=2, seed=2
    )
    build_tiny_model(
        folder / "cost", family="llama", head="score", hidden_size=64, num_layers=2, seed=3
    )
    write_digit_task(folder / "train.jsonl", "reverse", n=1000, min_len=3, max_len=5, seed=0)
    write_digit_task(folder / "val.jsonl", "reverse", n=32, min_len=3, max_len=5, seed=1)
    return folder


if __name__ == "__main__":
    print(make_assets(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))
