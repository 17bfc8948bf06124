"""An OpenEnv environment server on loopback trains end to end (``env: {kind: openenv}``): the
game of :mod:`hf_testing.openenv_game`, written with openenv-core's own server classes,
drives multi-turn episodes through the policy endpoint; a server that answers garbage or
dies mid-episode costs its samples, not the run."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hf_core.config import TrainerConfig, validate
from hf_core.trainer import RLTrainer

pytest.importorskip("openenv.core")
pytest.importorskip("websockets")

from hf_testing.openenv_game import MAX_GUESSES, serve

TASK = "digit_guess"


@pytest.fixture(scope="module")
def game_url() -> Iterator[str]:
    with serve() as url:
        yield url


def _config(url: str, out: Path, steps: int) -> TrainerConfig:
    recipe: dict[str, Any] = {
        "run": {"name": "openenv", "output_dir": str(out), "total_steps": steps,
                "val_every": steps, "progress": False},
        "model": {"path": "runs/assets/chat_policy"},
        "data": {"batch_size": 6, "val_batch_size": 4},
        "placement": {"mode": "colocate", "processes": 2},
        "rollout": {"backend": "transformers", "n": 2, "max_new_tokens": 6},
        "actor": {"backend": "fsdp", "engine": {"lr": 1.0e-4}},
        "env": {"kind": "openenv", "url": url, "name": TASK, "observation_key": "prompt",
                "size": 24, "val_size": 4},
        "agent": {"max_turns": MAX_GUESSES, "max_total_tokens": 192, "timeout_s": 120},
        "algorithm": {"advantage": "grpo"},
    }  # fmt: skip
    return validate(TrainerConfig, recipe, "test_openenv")


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


@pytest.mark.usefixtures("ray_cluster")
def test_an_openenv_server_trains_three_steps(in_workdir: Path, game_url: str) -> None:
    out = in_workdir / "runs" / "openenv"
    RLTrainer(_config(game_url, out, steps=3)).fit()
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["agent/failed"] == 0 and row["agent/timed_out"] == 0
        # every episode took 1 to 3 turns: the server's done (a right guess) or the limit
        assert 1.0 <= row[f"env/{TASK}/turns"] <= MAX_GUESSES
        assert 0.0 <= row[f"env/{TASK}/reward"] <= 1.0
        assert row[f"env/{TASK}/reward"] == pytest.approx(row["reward/mean"])
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
    assert rows[-1][f"val/env/{TASK}/count"] == 4


@pytest.mark.usefixtures("ray_cluster")
def test_a_failing_environment_server_costs_its_samples(in_workdir: Path, game_url: str) -> None:
    """Through a relay that answers one episode in three with garbage and drops another one
    in three mid-episode: those samples count as failed and leave the loss; the rest train."""
    out = in_workdir / "runs" / "openenv_unreliable"
    with serve(unreliable_of=game_url) as relay:
        RLTrainer(_config(relay, out, steps=2)).fit()
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2]
    failed, samples = sum(row["agent/failed"] for row in rows), 2 * 6 * 2
    assert 0 < failed < samples  # the healthy third trained
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])


def test_a_server_that_is_gone_fails_the_episode_at_once() -> None:
    """Nothing listening (a server that died before the episode): the episode fails with the
    server's address at once, without a model request."""
    import asyncio
    import time

    from hf_core.agents.config import AgentConfig
    from hf_core.environments import build_environment
    from hf_core.environments.openenv_env import EnvironmentServerError
    from hf_testing.openenv_game import free_port

    url = f"http://127.0.0.1:{free_port()}"
    env: Any = build_environment({"kind": "openenv", "url": url, "connect_timeout_s": 5})
    began = time.monotonic()
    with pytest.raises(EnvironmentServerError, match=f"{url}: cannot open a session"):
        asyncio.run(env.run(None, env.records("train")[0], AgentConfig()))
    assert time.monotonic() - began < 5
