"""Asynchronous RL on a standalone rollout pool (``placement.mode: standalone``).

- ``max_staleness: 0`` on a rollout pool of its own is the synchronous loop: the same
  metrics and weights after 3 steps as the hybrid (colocated) loop, same seed.
- ``max_staleness: 1`` generates each next batch while the actor trains: every batch is at
  most one policy version old, the importance weights are 1 on fresh samples and not on
  one-version-old ones, and every weight sync delivers the whole model to the rollout rank
  (M / (t_g p_g) with t_g = p_g = 1).
- The same with a vLLM rollout pool.
- A checkpoint taken while a batch is in flight resumes by drawing that batch's prompts again
  and regenerating them with the restored weights.
- A rollout process killed mid-run ends the run with an error naming the rollout role within
  the failure timeout, and no process of the run is left; with ``run.max_restarts`` the run
  heals itself instead, resuming from its latest checkpoint.

Which weights generated a batch is the rollout pool's own account (``async/rollout_version``:
the actor's update count that came with the weights it loaded), checked against the schedule's
tag (``async/policy_version``).  The runs that must see the policy move use the
``hf_testing.signal_rewards:digit_share`` reward: the recipe's reward is 0 for the untrained
tiny policy, so its updates would change nothing.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    FLOAT32_ROLLOUT,
    LONG,
    RECIPES,
    exported_weights,
    logged_step_reached,
    stable_metrics,
)

from hf_core.config import TrainerConfig, load_config
from hf_core.runtime import WorkerLostError
from hf_core.trainer import RLTrainer

VOLATILE = (
    "timing/",
    "perf/",
    "memory/",
    "timestamp",
    "handover/",  # the colocated actor moves its rollout engine's memory; a standalone one not
    "reshard/",  # only the standalone sync reports bytes per rollout rank
    "weight_sync/",
    "sync/",  # the standalone sync's wire counts and timings
    "async/",
)


def _config(out: Path, *overrides: str) -> TrainerConfig:
    return load_config(
        TrainerConfig,
        RECIPES / "grpo.yaml",
        [
            f"run.output_dir={out}",
            "run.total_steps=3",
            "run.export_final=true",
            "run.val_every=0",
            "run.progress=false",
            "run.torch_threads=1",  # same kernels (and float sums) in both placements
            "placement.processes=1",
            FLOAT32_ROLLOUT,  # the checks compare log-probs to float32 summation order
            *overrides,
        ],
    )


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


STANDALONE = ("placement.mode=standalone", "placement.rollout_processes=1")
LEARNS = "reward.function=hf_testing.signal_rewards:digit_share"
"""Varied rewards within each group: every update moves the policy."""


def _versions_agree(rows: list[dict]) -> None:
    """The schedule's version tag of each batch is the one the rollout pool generated with."""
    assert [r["async/rollout_version"] for r in rows] == [r["async/policy_version"] for r in rows]


@pytest.mark.usefixtures("ray_cluster")
def test_staleness_zero_on_a_rollout_pool_is_the_synchronous_loop(in_workdir: Path) -> None:
    hybrid_out, pool_out = in_workdir / "runs" / "sync_hybrid", in_workdir / "runs" / "sync_pool"
    RLTrainer(_config(hybrid_out, LEARNS)).fit()
    RLTrainer(_config(pool_out, LEARNS, *STANDALONE, "rollout.max_staleness=0")).fit()

    hybrid, pool = _rows(hybrid_out), _rows(pool_out)
    assert [r["step"] for r in pool] == [1, 2, 3]
    assert [stable_metrics(r, VOLATILE) for r in pool] == [
        stable_metrics(r, VOLATILE) for r in hybrid
    ]
    assert all(r["async/staleness"] == 0 for r in pool)
    assert [r["async/rollout_version"] for r in pool] == [0, 1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in pool)  # the weights the pool gets do change
    a, b = exported_weights(hybrid_out), exported_weights(pool_out)
    assert a.keys() == b.keys() and a
    assert all(a[k].equal(b[k]) for k in a)
    for row in pool:  # every update's weights reached the pool, all of them
        assert row["reshard/bytes_received"] == row["reshard/bytes_expected"] > 0
        assert row["sync/full"] == 1.0 and row["sync/pool_idle_s"] > 0


@pytest.mark.usefixtures("ray_cluster")
def test_delta_sync_to_a_pool_is_the_synchronous_loop_bit_for_bit(in_workdir: Path) -> None:
    """rollout.sync: delta with checksums on every delta and a full sync every 2 versions:
    the same metrics and weights as the hybrid loop, so the pool held exactly the actor's
    weights at every step."""
    hybrid_out, delta_out = in_workdir / "runs" / "sync_hybrid", in_workdir / "runs" / "delta"
    RLTrainer(_config(hybrid_out, LEARNS)).fit()
    delta_sync = ("rollout.sync=delta", "rollout.sync_verify=true", "rollout.sync_full_every=2")
    RLTrainer(_config(delta_out, LEARNS, *STANDALONE, "rollout.max_staleness=0", *delta_sync)).fit()
    hybrid, delta = _rows(hybrid_out), _rows(delta_out)
    assert [stable_metrics(r, VOLATILE) for r in delta] == [
        stable_metrics(r, VOLATILE) for r in hybrid
    ]
    a, b = exported_weights(hybrid_out), exported_weights(delta_out)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # each step's row has the sync its batch waited for: versions 0 (the first: full), 1
    # (a delta on 0) and 2 (full again: sync_full_every)
    assert [r["sync/full"] for r in delta] == [1.0, 0.0, 1.0]
    assert all(r["sync/healed"] == 0 for r in delta)
    for row in delta:
        assert 0 < row["sync/changed_fraction"] <= 1
        assert row["reshard/bytes_received"] == row["reshard/bytes_expected"] > 0


@pytest.mark.usefixtures("ray_cluster")
def test_one_step_off_policy_is_bounded_and_corrected(in_workdir: Path) -> None:
    out = in_workdir / "runs" / "async1"
    overrides = (*STANDALONE, LEARNS, "rollout.max_staleness=1", "run.total_steps=4")
    RLTrainer(_config(out, *overrides)).fit()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Step 1 trains on the initial weights' samples; from then on each batch was generated
    # while the previous step trained, one version behind -- by the pool's own account too.
    assert [r["async/staleness"] for r in rows] == [0, 1, 1, 1]
    assert [r["async/policy_version"] for r in rows] == [0, 0, 1, 2]
    _versions_agree(rows)
    assert all(r["async/dropped_samples"] == 0 for r in rows)
    # pi_old / pi_rollout: 1 up to float noise on the current weights' samples; one update
    # away on the others (the largest ratio before truncation shows it).
    fresh, stale = rows[0], rows[1:]
    assert fresh["rollout/logprob_abs_diff_mean"] < 1e-4
    assert fresh["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert fresh["actor/is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    for row in stale:
        assert row["rollout/logprob_abs_diff_mean"] > 1e-3, row
        assert row["actor/is_weight_max"] > 1.01, row
        assert 0 < row["actor/is_weight_mean"] <= 2.0  # truncated at algorithm.rollout_is_cap
    syncs = [r for r in rows if "reshard/bytes_received" in r]
    assert syncs, "no weight sync reached the rollout pool"
    for row in syncs:
        assert row["reshard/bytes_received"] == row["reshard/bytes_expected"] > 0


@pytest.mark.usefixtures("ray_cluster")
def test_a_vllm_rollout_pool_runs_ahead(in_workdir: Path) -> None:
    out = in_workdir / "runs" / "async_vllm"
    overrides = (
        "rollout.backend=vllm",
        "rollout.engine.kv_cache_bytes=268435456",
        "rollout.max_staleness=1",
    )
    RLTrainer(_config(out, *STANDALONE, *overrides)).fit()
    rows = _rows(out)
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    _versions_agree(rows)
    for row in rows:
        assert row["rollout/logprob_abs_diff_mean"] < 0.5  # the pool got the actor's weights
    syncs = [r for r in rows if "reshard/bytes_received" in r]
    assert syncs and all(
        r["reshard/bytes_received"] == r["reshard/bytes_expected"] > 0 for r in syncs
    )


def _loader_offset(out: Path, step: int) -> int:
    doc = json.loads((out / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())
    return int(doc["state"]["loader"]["offset"])


@pytest.mark.usefixtures("ray_cluster")
def test_a_checkpoint_with_a_batch_in_flight_regenerates_it(in_workdir: Path) -> None:
    out = in_workdir / "runs" / "async_resume"
    common = (*STANDALONE, "rollout.max_staleness=1", "run.save_every=2")
    # Stops after step 3 with the checkpoint of step 2, taken while batch 3 was generating.
    RLTrainer(_config(out, *common, "run.total_steps=3", "run.save_final=false")).fit()
    batch = 8  # grpo.yaml's data.batch_size
    assert _loader_offset(out, 2) == 2 * batch  # batch 3 was drawn, but is not counted
    RLTrainer(_config(out, *common, "run.total_steps=4"), resume=True).fit()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Step 3 regenerates its batch with the restored weights (version 2): not stale.
    assert [r["async/staleness"] for r in rows] == [0, 1, 0, 1]
    assert rows[2]["async/policy_version"] == 2
    _versions_agree(rows)


class KillRolloutAfterStep(threading.Thread):
    """SIGKILLs the rollout process once metrics.jsonl reaches a step (as the OOM killer
    would), and records every process of the run."""

    def __init__(self, trainer: RLTrainer, step: int) -> None:
        super().__init__(daemon=True)
        self.trainer, self.step = trainer, step
        self.killed_at: float | None = None
        self.pids: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            roles = self.trainer.roles
            if (
                roles is not None
                and roles.rollout is not None
                and logged_step_reached(self.trainer.output_dir, self.step)
            ):
                self.pids = [*roles.actor.pids, *roles.rollout.pids]
                self.killed_at = time.monotonic()
                os.kill(roles.rollout.pids[0], signal.SIGKILL)
                return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


@pytest.mark.usefixtures("ray_cluster")
def test_a_killed_rollout_process_ends_the_run_naming_it(in_workdir: Path) -> None:
    timeout_s = 10
    trainer = RLTrainer(
        _config(
            in_workdir / "runs" / "async_killed",
            *STANDALONE,
            "rollout.max_staleness=1",
            "run.total_steps=40",
            f"cluster.failure_timeout_s={timeout_s}",
            "run.max_restarts=0",  # the error itself is under test, not the self-healing
        )
    )
    killer = KillRolloutAfterStep(trainer, step=2)
    killer.start()
    with pytest.raises(WorkerLostError) as raised:
        trainer.fit()
    failed_at = time.monotonic()
    killer.stop.set()
    assert killer.killed_at is not None, "the rollout process was never killed"
    assert raised.value.role == "rollout" and raised.value.rank == 0, raised.value
    assert failed_at - killer.killed_at < timeout_s + 30
    assert trainer.roles is None
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in killer.pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in killer.pids if _alive(p)], "processes of the run still running"


HEAL_STEPS, HEAL_SAVE_EVERY, KILL_AFTER = 5, 3, 3
"""The kill lands while step 3 is saved or step 4 runs (the save needs no rollout process, step
4's weight sync does), so the run fails in step 4 or 5 and its latest checkpoint is step 3's."""


@LONG  # the default run checks the kill is reported (the test above)
@pytest.mark.usefixtures("ray_cluster")
def test_a_killed_rollout_process_heals_with_restarts(in_workdir: Path) -> None:
    """The healed run resumes from the step-3 checkpoint, not from step 0: its first three
    steps are the uninterrupted run's, step 4 regenerates its in-flight batch with the
    restored weights (fresh, where the uninterrupted run's was a version old), and step 5's
    batch -- version 3 weights, same prompts and seed -- is the uninterrupted run's again."""
    common = (
        *STANDALONE,
        LEARNS,
        "rollout.max_staleness=1",
        f"run.total_steps={HEAL_STEPS}",
        f"run.save_every={HEAL_SAVE_EVERY}",
        "cluster.failure_timeout_s=10",
        "run.max_restarts=1",
    )
    straight_out, out = in_workdir / "runs" / "async_straight", in_workdir / "runs" / "async_healed"
    RLTrainer(_config(straight_out, *common)).fit()
    trainer = RLTrainer(_config(out, *common))
    killer = KillRolloutAfterStep(trainer, step=KILL_AFTER)
    killer.start()
    trainer.fit()
    killer.stop.set()
    assert killer.killed_at is not None, "the rollout process was never killed"
    assert len(trainer.restarts) == 1 and "rollout" in trainer.restarts[0]
    assert trainer.start_steps == [0, HEAL_SAVE_EVERY]  # the checkpoint's step, not 0

    healed, straight = _rows(out), _rows(straight_out)
    assert [r["step"] for r in healed] == [1, 2, 3, 4, 5]
    _versions_agree(healed)
    assert [stable_metrics(r, VOLATILE) for r in healed[:3]] == [
        stable_metrics(r, VOLATILE) for r in straight[:3]
    ]
    assert [r["async/staleness"] for r in straight] == [0, 1, 1, 1, 1]
    assert [r["async/staleness"] for r in healed] == [0, 1, 1, 0, 1]
    assert [r["async/rollout_version"] for r in healed[3:]] == [3, 3]
    for key in ("reward/mean", "response_length/mean"):
        assert healed[4][key] == straight[4][key], key
