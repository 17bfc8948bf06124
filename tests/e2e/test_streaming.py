"""Streaming rollouts with partial rollouts (``rollout.mode: streaming``, docs/async.md).

- With ``max_staleness: 0`` streaming is the synchronous loop: every metric but timings and
  the streaming accounts equals the batch loop's on the same placement, and so do the
  exported weights.
- With ``max_staleness: 1`` every token trained is at most one version older than the weights
  being trained, responses under way when new weights arrive continue on them (tokens of two
  versions in one sample), and the prompt ledger lists every prompt drawn exactly once, each
  trained at one step, none lost.
- A checkpoint taken with prompts in flight resumes by submitting exactly those again.
- A vLLM pool streams too (in chunks: ChunkedStream).
- A rollout process killed mid-generation heals with ``run.max_restarts``; the final ledger
  has every prompt once, none lost, and the failed attempt's ledger names the prompts it lost.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import LONG, stable_metrics
from test_async import LEARNS, STANDALONE, VOLATILE, KillRolloutAfterStep, _config, _rows

from hf_core.trainer import RLTrainer

STREAMING = "rollout.mode=streaming"
STREAM_VOLATILE = (*VOLATILE, "stream/", "prompts/")


def _ledger(out: Path, name: str = "prompt_ledger.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.mark.usefixtures("ray_cluster")
def test_streaming_at_staleness_zero_is_the_synchronous_loop(in_workdir: Path) -> None:
    batch_out, stream_out = in_workdir / "runs" / "batch0", in_workdir / "runs" / "stream0"
    common = (LEARNS, *STANDALONE, "rollout.max_staleness=0")
    RLTrainer(_config(batch_out, *common)).fit()
    RLTrainer(_config(stream_out, *common, STREAMING)).fit()
    batch, stream = _rows(batch_out), _rows(stream_out)
    assert [r["step"] for r in stream] == [1, 2, 3]
    assert [stable_metrics(r, STREAM_VOLATILE) for r in stream] == [
        stable_metrics(r, STREAM_VOLATILE) for r in batch
    ]
    assert [r["async/staleness_max"] for r in stream] == [0, 0, 0]
    assert all(r["stream/interrupted_samples"] == 0 for r in stream)
    rows = _ledger(stream_out)
    assert Counter(r["state"] for r in rows) == {"trained": 3 * 8}


@pytest.mark.usefixtures("ray_cluster")
def test_streaming_one_version_ahead_with_partial_rollouts(in_workdir: Path) -> None:
    out = in_workdir / "runs" / "stream1"
    steps = 5
    RLTrainer(
        _config(
            out,
            LEARNS,
            *STANDALONE,
            STREAMING,
            "rollout.max_staleness=1",
            f"run.total_steps={steps}",
            "rollout.max_new_tokens=24",
            "rollout.stream_chunk_tokens=2",
            "rollout.stream_capacity=4",  # one group at a time: the pool is the slower side
        )
    ).fit()
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # no token trained is more than one version older than the weights trained
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert rows[0]["async/staleness_max"] == 0
    assert max(r["async/staleness_max"] for r in rows) == 1  # the pool ran ahead
    # new weights reached responses under way: some samples hold tokens of two versions
    assert sum(r["stream/interrupted_samples"] for r in rows) > 0
    assert max(r["stream/version_spread_max"] for r in rows) >= 1
    ledger = _ledger(out)
    ids = [(r["epoch"], r["sample_index"]) for r in ledger]
    assert len(ids) == len(set(ids))
    trained = [r for r in ledger if r["state"] == "trained"]
    dropped = [r for r in ledger if r["state"] == "dropped"]
    assert len(trained) == steps * 8
    assert Counter(r["detail"] for r in trained) == {s: 8 for s in range(1, steps + 1)}
    assert rows[-1]["async/dropped_samples"] == 4 * len(dropped)
    assert not [r for r in ledger if r["state"] == "lost"]


@pytest.mark.usefixtures("ray_cluster")
def test_a_streaming_checkpoint_resubmits_the_prompts_in_flight(in_workdir: Path) -> None:
    out = in_workdir / "runs" / "stream_resume"
    common = (*STANDALONE, STREAMING, "rollout.max_staleness=1", "run.save_every=2")
    RLTrainer(_config(out, *common, "run.total_steps=3", "run.save_final=false")).fit()
    state = json.loads((out / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    saved = state["state"]["rollouts"]["ledger"]["rows"]
    in_flight = {(r["epoch"], r["sample_index"]) for r in saved if r["state"] == "in_flight"}
    assert in_flight, "nothing was in flight at the checkpoint"
    RLTrainer(_config(out, *common, "run.total_steps=4"), resume=True).fit()
    ledger = _ledger(out)
    states = {(r["epoch"], r["sample_index"]): r for r in ledger}
    # every prompt in flight at the checkpoint was trained (or dropped) after it, none lost
    for pid in in_flight:
        assert states[pid]["state"] in ("trained", "dropped", "in_flight"), states[pid]
    trained_steps = Counter(r["detail"] for r in ledger if r["state"] == "trained")
    assert trained_steps == {1: 8, 2: 8, 3: 8, 4: 8}
    before = {(r["epoch"], r["sample_index"]) for r in saved if r["state"] == "trained"}
    assert all(states[pid]["detail"] in (1, 2) for pid in before)  # not trained again


@pytest.mark.usefixtures("ray_cluster")
def test_a_vllm_pool_streams_in_chunks(in_workdir: Path) -> None:
    """vLLM has no token-level stream here: ChunkedStream resubmits prompt + response so far
    every few tokens, and updates land between chunks."""
    out = in_workdir / "runs" / "stream_vllm"
    overrides = (
        "rollout.backend=vllm",
        "rollout.engine.kv_cache_bytes=268435456",
        "rollout.max_staleness=1",
        "rollout.max_new_tokens=16",
        "rollout.stream_chunk_tokens=4",
        "rollout.stream_capacity=4",
    )
    RLTrainer(_config(out, LEARNS, *STANDALONE, STREAMING, *overrides)).fit()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    for row in rows:
        assert row["rollout/logprob_abs_diff_mean"] < 0.5  # the pool got the actor's weights
    assert sum(r["stream/interrupted_samples"] for r in rows) > 0
    ledger = _ledger(out)
    assert Counter(r["detail"] for r in ledger if r["state"] == "trained") == {1: 8, 2: 8, 3: 8}


@LONG  # like the batch loop's healing test: a restart costs a minute
@pytest.mark.usefixtures("ray_cluster")
def test_a_killed_streaming_pool_heals_and_the_ledger_loses_no_prompt(in_workdir: Path) -> None:
    out = in_workdir / "runs" / "stream_healed"
    steps = 5
    trainer = RLTrainer(
        _config(
            out,
            *STANDALONE,
            STREAMING,
            "rollout.max_staleness=1",
            f"run.total_steps={steps}",
            "run.save_every=2",
            "cluster.failure_timeout_s=10",
            "run.max_restarts=1",
        )
    )
    killer = KillRolloutAfterStep(trainer, step=3)
    killer.start()
    trainer.fit()
    killer.stop.set()
    assert killer.killed_at is not None, "the rollout process was never killed"
    assert len(trainer.restarts) == 1 and "rollout" in trainer.restarts[0]
    assert trainer.start_steps == [0, 2]
    assert [r["step"] for r in _rows(out)] == list(range(1, steps + 1))
    ledger = _ledger(out)
    ids = [(r["epoch"], r["sample_index"]) for r in ledger]
    assert len(ids) == len(set(ids))  # one row per prompt: none trained twice
    trained = Counter(r["detail"] for r in ledger if r["state"] == "trained")
    assert trained == {s: 8 for s in range(1, steps + 1)}
    assert not [r for r in ledger if r["state"] == "lost"]
    # the failed attempt's account names the prompts it lost in flight
    failed = _ledger(out, "prompt_ledger.attempt1.jsonl")
    lost = {(r["epoch"], r["sample_index"]) for r in failed if r["state"] == "lost"}
    assert lost and all(
        r["detail"].startswith("WorkerLostError") for r in failed if r["state"] == "lost"
    )
    # every prompt lost there was trained (or is in flight at the end) in the healed run
    final = {(r["epoch"], r["sample_index"]): r["state"] for r in ledger}
    assert all(final.get(pid) in ("trained", "in_flight") for pid in lost)


@pytest.mark.usefixtures("ray_cluster")
def test_dynamic_sampling_draws_from_the_stream_and_the_ledger_keeps_count(
    in_workdir: Path,
) -> None:
    """DAPO's dynamic sampling on a stream: an untrained policy mostly scores 0 on the digit
    task, so most groups are uniform; more groups are taken from the stream, the filtered
    ones are dropped in the ledger (not trained), and each step still trains 8 groups."""
    out = in_workdir / "runs" / "stream_dynamic"
    overrides = (
        "rollout.max_staleness=1",
        "algorithm.dynamic_sampling.enabled=true",
        "algorithm.dynamic_sampling.max_rounds=2",
    )
    RLTrainer(_config(out, *STANDALONE, STREAMING, *overrides)).fit()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert (
            row["dynamic_sampling/uniform_groups_trained"] == row["dynamic_sampling/short_groups"]
        )
    ledger = _ledger(out)
    ids = [(r["epoch"], r["sample_index"]) for r in ledger]
    assert len(ids) == len(set(ids))
    trained = Counter(r["detail"] for r in ledger if r["state"] == "trained")
    assert trained == {1: 8, 2: 8, 3: 8}
    left_out = [r for r in ledger if r["state"] == "dropped" and "dynamic" in r["detail"]]
    drawn = sum(r["dynamic_sampling/groups_drawn"] for r in rows)
    assert drawn > 3 * 8, "no group was filtered: the test task no longer has uniform groups"
    assert len(left_out) == drawn - 3 * 8
