"""Routing replay through streaming rollouts with partial rollouts (docs/moe.md, docs/async.md):
``recipes/grpo_stream.yaml`` on the tiny Qwen3-MoE (transformers pool, chunks of two tokens so
updates land mid-response) trains with ``algorithm.router_replay: rollout``.

- Every step's batch carries the experts (``moe/routing_bytes``) and the update logs the
  router agreement.
- Step 1 trains the first weights' own samples (float32): the recorded experts sit on the
  columns of the tokens they routed, so the trainer's router agrees with every recorded set
  and the recomputed log-probs equal the rollout's up to summation order (misplaced experts
  would route tokens elsewhere and move them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FLOAT32_ROLLOUT, RECIPES

from hf_core.config import TrainerConfig, load_config
from hf_core.trainer import RLTrainer


@pytest.mark.usefixtures("ray_cluster")
def test_streaming_partial_rollouts_carry_the_moe_routing(in_workdir: Path) -> None:
    out = in_workdir / "runs" / "moe_stream"
    config = load_config(
        TrainerConfig,
        RECIPES / "grpo_stream.yaml",
        [
            "model.path=runs/assets/moe_policy",
            f"run.output_dir={out}",
            "run.total_steps=2",
            "run.val_every=0",
            "run.progress=false",
            "run.torch_threads=1",
            FLOAT32_ROLLOUT,
            "rollout.stream_chunk_tokens=2",
            "rollout.stream_capacity=4",  # one group at a time: updates find responses under way
        ],
    )
    assert config.algorithm.router_replay == "rollout"
    RLTrainer(config).fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["moe/routing_bytes"] > 0
        assert 0.0 < row["actor/moe/router_agreement"] <= 1.0
    first = rows[0]
    assert first["async/staleness_max"] == 0
    assert first["actor/moe/router_agreement"] >= 0.99
    assert first["rollout/logprob_abs_diff_max"] <= 1e-4
