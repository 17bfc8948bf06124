"""Resume: 6 steps straight == 3 steps, stop, --resume, 3 more (metrics and weights).

Cases: inside an epoch (the full 1000-prompt task); exactly at an epoch's end (a 24-prompt
file, 3 batches of 8 per epoch), where the resumed run must go on into the next epoch with the
order an uninterrupted run uses; and a LoRA actor (adapters, their optimiser state, merged and
peft exports).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import LONG, RECIPES, exported_weights, stable_metrics

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer

VOLATILE = (
    "timing/",
    "perf/step_s",
    "perf/throughput",
    "perf/weight_sync_s",
    "memory/",
    "timestamp",
    # The hand-overs of a save (to_training) are counted into the next step's bytes; a
    # resumed process has no such save before its first step, so step k+1 differs there.
    "handover/",
)
EPOCH_PROMPTS = 24  # with data.batch_size 8: 3 steps per epoch, so step 3 ends epoch 0


def _run(out: Path, steps: int, extra: list[str], resume: bool = False) -> list[dict]:
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
            *extra,
        ],
    )
    RLTrainer(config, resume=resume).fit()
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def _small_train_file(workdir: Path) -> Path:
    """The first EPOCH_PROMPTS prompts of the task, as a training file of their own."""
    lines = (workdir / "runs" / "assets" / "train.jsonl").read_text().splitlines()
    path = workdir / "runs" / "assets" / f"train{EPOCH_PROMPTS}.jsonl"
    path.write_text("\n".join(lines[:EPOCH_PROMPTS]) + "\n")
    return path


def _loader_position(out: Path, step: int) -> tuple[int, int]:
    doc = json.loads((out / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())
    return doc["state"]["loader"]["epoch"], doc["state"]["loader"]["offset"]


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize(
    "case",
    ["mid_epoch", pytest.param("epoch_boundary", marks=LONG), pytest.param("lora", marks=LONG)],
)
def test_resume_matches_an_uninterrupted_run(in_workdir: Path, case: str) -> None:
    extra = []
    if case == "epoch_boundary":
        extra = [f"data.train_files=[{_small_train_file(in_workdir)}]", "data.batch_size=8"]
    if case == "lora":  # adapters + their AdamW state; the reference is the adapter-less actor
        extra = ["actor.engine.lora.rank=8", "actor.engine.lr=5e-3"]
    straight_dir = in_workdir / "runs" / case / "straight"
    stopped_dir = in_workdir / "runs" / case / "stopped"
    straight = _run(straight_dir, 6, extra)
    _run(stopped_dir, 3, extra)
    if case == "epoch_boundary":  # stopped right after epoch 0's last batch
        assert _loader_position(stopped_dir, 3) == (1, 0)
    resumed = _run(stopped_dir, 6, extra, resume=True)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [stable_metrics(r, VOLATILE) for r in resumed] == [
        stable_metrics(r, VOLATILE) for r in straight
    ]
    a, b = exported_weights(straight_dir), exported_weights(stopped_dir)
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].equal(b[name]), name
    if case == "lora":  # the adapters in peft format, next to the merged weights
        from safetensors.torch import load_file

        adapters = [
            load_file(out / "actor_hf" / "adapter" / "adapter_model.safetensors")
            for out in (straight_dir, stopped_dir)
        ]
        assert adapters[0].keys() == adapters[1].keys() and adapters[0]
        assert all(adapters[0][k].equal(adapters[1][k]) for k in adapters[0])
