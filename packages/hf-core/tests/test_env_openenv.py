"""The OpenEnv adapter's parts that need no server: the protocol frames it accepts and the
ones it fails an episode on, the episodes' seeds, its settings, and what an environment that
runs its own episodes does to a recipe (tests/e2e/test_openenv.py trains against a real
openenv-core server)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from hf_core.config import TrainerConfig, validate
from hf_core.environments import build_environment, kind_runs_rollouts, openenv_env
from hf_core.environments.openenv_env import EnvironmentServerError, _parse
from hf_core.errors import ConfigError
from hf_testing.missing_library import pretend_missing

URL = "http://127.0.0.1:9"


@pytest.fixture
def no_socket_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter without ``websockets`` installed: only its connect is missing."""
    monkeypatch.setattr(openenv_env, "_websockets", lambda: SimpleNamespace(connect=None))


def _frame(**data: Any) -> str:
    return json.dumps({"type": "observation", "data": data})


def test_an_observation_frame_gives_observation_reward_and_done() -> None:
    assert _parse(_frame(observation={"prompt": "hi"}, reward=0.5, done=True), "step", URL) == (
        {"prompt": "hi"},
        0.5,
        True,
    )
    assert _parse(_frame(observation={}, reward=None, done=False), "reset", URL) == ({}, 0.0, False)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("<html>502 Bad Gateway</html>", "non-JSON"),
        ("[1, 2]", "not a frame"),
        (json.dumps({"type": "error", "data": {"message": "boom", "code": "EXECUTION_ERROR"}}),
         "refused: boom"),
        (json.dumps({"type": "state", "data": {}}), "'state' frame"),
        (_frame(reward=1.0, done=True), "no observation object"),
        (_frame(observation="text", reward=1.0, done=True), "no observation object"),
        (_frame(observation={}, reward="1", done=True), "not a number"),
        (_frame(observation={}, reward=True, done=True), "not a number"),
        (_frame(observation={}, reward=float("nan"), done=True), "not a number"),
        (_frame(observation={}, reward=1.0, done="yes"), "not a boolean"),
        (_frame(observation={}, reward=1.0), "not a boolean"),
    ],
)  # fmt: skip
def test_anything_but_the_protocol_fails_the_episode(raw: str, message: str) -> None:
    with pytest.raises(EnvironmentServerError, match=message):
        _parse(raw, "step", URL)


@pytest.mark.usefixtures("no_socket_library")
def test_episodes_reset_with_their_own_seeds_and_splits_share_none() -> None:
    env = build_environment({"kind": "openenv", "url": URL, "size": 5, "val_size": 3, "seed": 7})
    train, val = env.records("train"), env.records("val")
    assert [r["env_seed"] for r in train] == [7, 8, 9, 10, 11]
    assert [r["env_seed"] for r in val] == [12, 13, 14]
    assert {r["env_task"] for r in train + val} == {"openenv"}
    again = build_environment({"kind": "openenv", "url": URL, "size": 5, "seed": 7})
    assert again.records("train") == train


@pytest.mark.usefixtures("no_socket_library")
def test_observations_and_answers_map_through_the_keys() -> None:
    env: Any = build_environment({"kind": "openenv", "url": URL, "observation_key": "prompt"})
    assert env._message({"prompt": "guess", "left": 2}) == "guess"
    with pytest.raises(EnvironmentServerError, match="no text field 'prompt'"):
        env._message({"text": "guess"})
    assert env._action("7") == {"message": "7"}
    whole: Any = build_environment({"kind": "openenv", "url": URL, "action_key": None})
    assert whole._message({"b": 1, "a": "x"}) == '{"a": "x", "b": 1}'
    assert whole._action('{"move": "e4"}') == {"move": "e4"}
    with pytest.raises(ValueError, match="not a JSON action object"):
        whole._action("e4")
    assert env.ws_url == "ws://127.0.0.1:9/ws"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, r"env\.url"),
        ({"url": "127.0.0.1:8000"}, r"env\.url"),
        ({"url": URL, "size": 0}, r"env\.size"),
        ({"url": URL, "colour": "red"}, r"env\.colour"),
    ],
)
@pytest.mark.usefixtures("no_socket_library")
def test_bad_settings_name_the_key(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_environment({"kind": "openenv", **settings})


def test_a_missing_socket_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_missing(monkeypatch, "websockets")
    with pytest.raises(ConfigError, match=r"pip install 'hf-core\[openenv\]'"):
        build_environment({"kind": "openenv", "url": URL})


def _recipe(**extra: Any) -> dict[str, Any]:
    return {"model": {"path": "/models/tiny"}, "env": {"kind": "openenv", "url": URL}, **extra}


def test_an_environment_running_episodes_makes_every_sample_an_agent_run() -> None:
    assert kind_runs_rollouts("openenv")
    assert not kind_runs_rollouts("reasoning_gym") and not kind_runs_rollouts("no_such_kind")
    config = validate(TrainerConfig, _recipe(), "test")
    assert config.agent is not None and config.agent.function is None  # the default limits
    assert config.runs_agent_function
    limited = validate(TrainerConfig, _recipe(agent={"max_turns": 2}), "test")
    assert limited.agent is not None and limited.agent.max_turns == 2
    plain = validate(
        TrainerConfig, {"model": {"path": "/m"}, "reward": {"function": "digit_match"}}, "t"
    )
    assert not plain.runs_agent_function


def test_an_agent_function_beside_such_an_environment_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"agent\.function.*runs each sample's episode"):
        validate(TrainerConfig, _recipe(agent={"function": "my_pkg.agents:run"}), "test")
