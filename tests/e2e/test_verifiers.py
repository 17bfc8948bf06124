"""A multi-turn ``verifiers`` environment trains end to end (``env: {kind: verifiers}``): the
digit-guessing game of :mod:`hf_testing.verifiers_guess`, written with the library's own
classes, runs its episodes through the library against the policy endpoint; its rubric's
scores are the rewards trained on, and the trained tokens are the sampled ones."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hf_core.config import TrainerConfig, validate
from hf_core.trainer import RLTrainer

pytest.importorskip("verifiers.v1")

TASK = "digit_guess"
TASKS, VAL_TASKS = 40, 4
BATCH, SAMPLES = 4, 2


@pytest.mark.usefixtures("ray_cluster")
def test_a_verifiers_multi_turn_environment_trains_three_steps(in_workdir: Path) -> None:
    out = in_workdir / "runs" / "verifiers"
    rubric_log = in_workdir / "runs" / "verifiers_rubric.jsonl"
    recipe: dict[str, Any] = {
        "run": {"name": "verifiers", "output_dir": str(out), "total_steps": 3, "val_every": 3,
                "progress": False},
        "model": {"path": "runs/assets/chat_policy"},
        "data": {"batch_size": BATCH, "val_batch_size": VAL_TASKS},
        "placement": {"mode": "colocate", "processes": 2},
        "rollout": {"backend": "transformers", "n": SAMPLES, "max_new_tokens": 6,
                    "engine": {"dtype": "float32"}},
        "actor": {"backend": "fsdp", "engine": {"lr": 1.0e-4}},
        "env": {"kind": "verifiers", "environment": "hf_testing.verifiers_guess", "name": TASK,
                "taskset": {"count": TASKS, "log_file": str(rubric_log)}, "val_size": VAL_TASKS},
        "agent": {"max_turns": 3, "max_total_tokens": 192, "timeout_s": 120},
        "algorithm": {"advantage": "grpo"},
    }  # fmt: skip
    RLTrainer(validate(TrainerConfig, recipe, "test_verifiers")).fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        # every episode's requests were the exact continuation of its trajectory's tokens
        assert row["agent/failed"] == 0 and row["agent/timed_out"] == 0
        assert 1.0 <= row[f"env/{TASK}/turns"] <= 3.0
        # trained on the tokens the engine sampled: training log-probs match the rollout's
        assert row["rollout/logprob_abs_diff_max"] < 1e-3
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
    assert rows[-1][f"val/env/{TASK}/count"] == VAL_TASKS
    # the rubric's scores (logged by the rubric itself) are the rewards trained on
    scored = [json.loads(line) for line in rubric_log.open()]
    trained = [r["reward"] for r in scored if r["task"] < TASKS - VAL_TASKS]
    assert len(trained) == 3 * BATCH * SAMPLES
    assert sum(trained) / len(trained) == pytest.approx(
        sum(row["reward/mean"] for row in rows) / len(rows), abs=1e-6
    )
    assert set(trained) <= {0.0, 0.25, 1.0}


def _environment(**settings: Any) -> Any:
    from hf_core.environments import build_environment

    return build_environment({"kind": "verifiers", "environment": "hf_testing.verifiers_guess",
                              **settings})  # fmt: skip


def test_the_taskset_splits_into_training_and_validation_tasks() -> None:
    env = _environment(taskset={"count": 10}, val_size=3, size=5)
    train, val = env.records("train"), env.records("val")
    assert [r["env_index"] for r in train] == [0, 1, 2, 3, 4]
    assert [r["env_index"] for r in val] == [7, 8, 9]
    assert train[0]["prompt"] == [{"role": "user", "content": "Guess my digit (0-9)."}]
    assert {r["env_task"] for r in train + val} == {"hf_testing.verifiers_guess"}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"environment": "no_such_verifiers_env"}, r"env\.environment"),
        ({"environment": "no_such_package.guess"}, r"env\.environment: cannot import"),
        ({"seat": "nobody"}, r"env\.seat: 'nobody' is not one of \['player'\]"),
        ({"taskset": {"count": 4}, "val_size": 4}, r"env\.val_size"),
        ({"taskset": {"colour": "red"}}, r"env: verifiers refused"),
        ({"colour": "red"}, r"env\.colour"),
    ],
)
def test_bad_settings_name_the_key(settings: dict[str, Any], message: str) -> None:
    from hf_core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _environment(**settings)
