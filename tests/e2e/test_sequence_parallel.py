"""Ulysses sequence parallelism in the running loop: ``actor.parallel.sp: 2`` is the same run.

GRPO with a reference, on two processes, once data parallel (each rank its own samples) and
once sequence parallel (both ranks the same samples, each computing half of every
micro-batch's tokens).  Generation is one chunk a rank either way, so the rollouts are the
same; the log-probs, losses and updates must then agree to rounding.  A dispatch that sent
the two ranks different samples, or a loss scaled for two data chunks, would not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FLOAT32_ROLLOUT, RECIPES

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer

pytestmark = pytest.mark.usefixtures("ray_cluster")

COMPARED = (
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/kl_loss",
    "actor/entropy",
    "critic/score/mean",
    "response_length/mean",
)


def _run(tmp: Path, sp: int) -> list[dict]:
    out = tmp / f"sp{sp}"
    config = load_config(
        TrainerConfig,
        RECIPES / "grpo.yaml",
        [
            "run.total_steps=2",
            "run.val_every=0",
            "run.progress=false",
            "run.save_every=0",
            "run.save_final=false",
            f"run.output_dir={out}",
            f"actor.parallel.sp={sp}",
            f"reference.parallel.sp={sp}",
            FLOAT32_ROLLOUT,
        ],
    )
    RLTrainer(config).fit()
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def test_sequence_parallel_actor_and_reference_run_the_data_parallel_loop(
    in_workdir: Path, tmp_path: Path
) -> None:
    plain, split = _run(tmp_path, 1), _run(tmp_path, 2)
    assert [row["step"] for row in split] == [1, 2]
    for before, after in zip(plain, split, strict=True):
        compared = [key for key in COMPARED if key in before]
        assert len(compared) >= 4, sorted(before)
        for key in compared:
            assert after[key] == pytest.approx(before[key], rel=1e-4, abs=1e-5), key
