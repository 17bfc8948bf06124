"""LoRA GRPO end to end on the demo task (digit reversal, partial credit per digit).

LoRA adapts a model that already knows something, so the base is first warm-started the way
the demo does it (100 supervised steps, full fine-tuning, exported as an HF folder); then
``recipes/grpo_lora.yaml`` trains only LoRA adapters on it with GRPO, KL to the reference =
the actor with its adapters disabled.  The mean reward of the last 10% of steps must beat the
first 10% by 0.2, as the demo's must.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FLOAT32_ROLLOUT, LONG, RECIPES, load_script

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer
from hf_testing.handover import check_handover_log

REQUIRED_GAIN = 0.2
QUIET = ["run.progress=false", "run.val_every=0"]
WARM_START = ["run.total_steps=1", "run.export_final=true", "run.save_final=false"]


def demo_assets(folder: Path) -> list[str]:
    """The demo's own model and task files (recipes/demo.py), as overrides."""
    demo = load_script(RECIPES / "demo.py")
    return [f"{key}={value}" for key, value in demo.build_assets(folder).items()]


def warm_start(assets: list[str], out: str) -> Path:
    """The demo's supervised warm start (full fine-tuning) of its tiny policy, exported."""
    config = load_config(
        TrainerConfig,
        RECIPES / "demo.yaml",
        [*assets, *QUIET, f"run.output_dir={out}", *WARM_START],
    )
    RLTrainer(config).fit()
    return config.run.output_dir / "actor_hf"


@LONG  # the default run: the grpo_lora recipes' 3 steps (test_recipes.py)
@pytest.mark.usefixtures("ray_cluster")
def test_lora_grpo_learns_the_demo_task(in_workdir: Path) -> None:
    assets = demo_assets(in_workdir / "runs" / "demo_assets")
    base = warm_start(assets, "runs/lora_base")
    config = load_config(
        TrainerConfig,
        RECIPES / "grpo_lora.yaml",
        [
            *assets,
            f"model.path={base}",
            *QUIET,
            "run.output_dir=runs/grpo_lora_learns",
            FLOAT32_ROLLOUT,  # the merged-weights check below is float32's
        ],
    )
    trainer = RLTrainer(config)
    summary = trainer.fit()
    assert summary.learning is not None
    assert summary.learning.delta >= REQUIRED_GAIN, str(summary.learning)

    check_handover_log(trainer.handover_log, ["actor"])  # no reference engine was built
    rows = [json.loads(line) for line in (config.run.output_dir / "metrics.jsonl").open()]
    assert max(row["actor/kl"] for row in rows) > 0  # the reference is the base, not the actor
    assert all(
        row["lora/adapters_only"] == 0.0 for row in rows
    )  # transformers engine: merged weights
    # Merged weights compute W x + s B (A x) as (W + s B A) x: float32 rounding only.  Over a
    # 150-step run the mean stays ~1e-6; one rare token of one step was seen at 1.7e-4 (the
    # per-step 1e-4 bound holds in the 3-step recipe runs and the engine tests).  A stale or
    # half-applied sync would be off by ~0.1-1 on average.
    assert max(row["rollout/logprob_abs_diff_mean"] for row in rows) <= 1e-5
    assert max(row["rollout/logprob_abs_diff_max"] for row in rows) <= 1e-3
