"""Resume: 6 steps straight == 3 steps, stop, --resume, 3 more (metrics and weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RECIPES
from safetensors.torch import load_file

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer

VOLATILE = (
    "timing/",
    "perf/step_s",
    "perf/throughput",
    "perf/weight_sync_s",
    "memory/",
    "timestamp",
)


def _run(out: Path, steps: int, resume: bool = False) -> list[dict]:
    config = load_config(
        TrainerConfig,
        RECIPES / "grpo.yaml",
        [
            f"run.output_dir={out}",
            f"run.total_steps={steps}",
            "run.save_every=3",
            "run.export_final=true",
            "run.val_every=0",
            "run.progress=false",
        ],
    )
    RLTrainer(config, resume=resume).fit()
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _weights(out: Path) -> dict:
    tensors = {}
    for file in sorted((out / "actor_hf").glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.usefixtures("ray_cluster")
def test_resume_matches_an_uninterrupted_run(in_workdir: Path) -> None:
    straight = _run(in_workdir / "runs" / "straight", 6)
    _run(in_workdir / "runs" / "stopped", 3)
    resumed = _run(in_workdir / "runs" / "stopped", 6, resume=True)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [_stable(r) for r in resumed] == [_stable(r) for r in straight]
    a, b = _weights(in_workdir / "runs" / "straight"), _weights(in_workdir / "runs" / "stopped")
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].equal(b[name]), name
