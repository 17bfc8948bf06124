"""GRPO end to end: FSDP actor (2 ranks on Ray) + one SGLang engine per rank, 3 steps; and
the same with a megatron actor (TP = 2 over the two ranks) resharded into SGLang.

The recipe is the shipped ``recipes/grpo.yaml`` with ``rollout.backend=sglang``, the
distributed weight-sync transport and a reward that a random model's samples already spread
out (see ``sglang_test_rewards``), on the assets ``recipes/make_assets.py`` builds.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
from conftest import needs_sglang

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer
from hf_testing.handover import check_handover_log

pytestmark = [needs_sglang, pytest.mark.usefixtures("ray_cluster")]

ROOT = Path(__file__).resolve().parents[3]
RECIPES = ROOT / "recipes"
OVERRIDES = [
    "run.total_steps=3",
    "run.val_every=3",
    "run.progress=false",
    "rollout.backend=sglang",
    "rollout.engine.weight_sync=distributed",
    "rollout.engine.max_total_tokens=4096",
    "reward.function=sglang_test_rewards:distinct_chars",  # spreads rewards of a random model
]

POOL = [
    "run.val_every=0",
    "placement.mode=standalone",
    "placement.processes=1",
    "placement.rollout_processes=1",
    "rollout.max_staleness=1",
]
"""SGLang on a rollout process of its own, one batch ahead of the actor."""


def make_assets(folder: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_assets", RECIPES / "make_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_assets(folder)


@pytest.fixture
def in_assets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder with the recipes' runs/assets, made the current directory."""
    make_assets(tmp_path / "runs" / "assets")
    monkeypatch.chdir(tmp_path)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    return tmp_path


def _rows(config: TrainerConfig) -> list[dict]:
    return [json.loads(line) for line in (config.run.output_dir / "metrics.jsonl").open()]


@pytest.mark.usefixtures("in_assets")
def test_grpo_with_sglang_rollout_runs_three_steps() -> None:
    config = load_config(TrainerConfig, RECIPES / "grpo.yaml", OVERRIDES)
    assert config.rollout.backend == "sglang"
    trainer = RLTrainer(config)
    trainer.fit()
    check_handover_log(trainer.handover_log, ["actor", "reference"])  # FSDP -> SGLang

    rows = _rows(config)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        for key in ("reward/mean", "actor/pg_loss", "actor/kl", "perf/weight_sync_s"):
            assert key in row and math.isfinite(row[key]), (row["step"], key)
        assert row["perf/weight_sync_s"] > 0
        assert row["response_length/mean"] > 0
    assert rows[0]["reward/std"] > 0 and rows[0]["actor/grad_norm"] > 0  # a real update
    # Step 1 trains from the initial weights (actor == reference); steps 2-3 start from
    # updated weights (synced into SGLang before their rollouts: weight_sync_s > 0 above).
    assert rows[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["actor/kl"] > 1e-6 and rows[2]["actor/kl"] > 1e-6
    assert "val/reward_mean" in rows[-1]
    print(
        "GRPO + SGLang:",
        [
            {k: row[k] for k in ("step", "reward/mean", "actor/kl", "perf/weight_sync_s")}
            for row in rows
        ],
    )


@pytest.mark.usefixtures("in_assets")
def test_megatron_tp2_actor_reshards_into_sglang() -> None:
    """megatron (t = 2) -> SGLang (whole tensors, t_g = 1): each rank gathers its TP peer's
    shard, half the model (Table 2), and the trainer drives the memory hand-over."""
    overrides = [
        *OVERRIDES,
        "run.val_every=0",
        "run.output_dir=runs/grpo_megatron_sglang",
        "actor.backend=megatron",
        "actor.parallel.tp=2",
        "actor.engine.micro_batch_size=4",
    ]
    config = load_config(TrainerConfig, RECIPES / "grpo.yaml", overrides)
    trainer = RLTrainer(config)
    trainer.fit()
    rows = _rows(config)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["reshard/bytes_received"] == row["reshard/bytes_expected"]
        assert row["reshard/bytes_received"] == row["reshard/model_bytes"] / 2
        assert row["reshard/zero_redundancy"] == 1.0  # t_g = 1: the whole model is the shard
        assert row["handover/rollout_release_bytes"] > 0
        assert row["handover/actor_offload_bytes"] > 0
    assert rows[1]["actor/kl"] > 1e-6  # the synced weights moved off the reference
    check_handover_log(trainer.handover_log, ["actor", "reference"])  # megatron -> SGLang


@pytest.mark.usefixtures("in_assets")
def test_sglang_rollout_pool_runs_ahead_of_the_actor() -> None:
    """Asynchronous GRPO: SGLang on a rollout process of its own (placement standalone),
    one batch ahead of the FSDP actor; every sync delivers the whole model to the pool."""
    overrides = [*OVERRIDES, *POOL, "run.output_dir=runs/grpo_async_sglang"]
    config = load_config(TrainerConfig, RECIPES / "grpo.yaml", overrides)
    RLTrainer(config).fit()
    rows = _rows(config)
    assert [row["async/staleness"] for row in rows] == [0, 1, 1]
    syncs = [row for row in rows if "reshard/bytes_received" in row]
    assert syncs
    for row in syncs:
        assert row["reshard/bytes_received"] == row["reshard/bytes_expected"] > 0
    assert abs(rows[2]["actor/kl"]) > 1e-6  # the actor moved off the reference


@pytest.mark.usefixtures("in_assets")
def test_sglang_rollout_pool_streams() -> None:
    """Streaming GRPO on an SGLang pool: chunks of a few tokens (ChunkedStream), groups handed
    over as they finish, updates landing between chunks; the ledger trains every prompt once."""
    overrides = [
        *OVERRIDES,
        *POOL,
        "run.output_dir=runs/grpo_stream_sglang",
        "rollout.mode=streaming",
        "rollout.stream_chunk_tokens=4",
    ]
    config = load_config(TrainerConfig, RECIPES / "grpo.yaml", overrides)
    RLTrainer(config).fit()
    rows = _rows(config)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["async/staleness_max"] <= 1 for row in rows)
    ledger = [
        json.loads(line)
        for line in (Path(config.run.output_dir) / "prompt_ledger.jsonl").read_text().splitlines()
    ]
    trained = [r for r in ledger if r["state"] == "trained"]
    assert len(trained) == 3 * config.data.batch_size
    assert len({(r["epoch"], r["sample_index"]) for r in ledger}) == len(ledger)
