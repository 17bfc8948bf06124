"""Backends arrive through entry points: a throwaway plugin package is installed for real."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hf_core import plugins
from hf_testing.plugin_packages import env_with_site, install_plugin_package

TOY_PLUGIN = """
from pydantic import BaseModel, ConfigDict, Field

from hf_core.plugins import hookimpl
from hf_core.protocols import DP_PROTO, TransferProtocol


def _reversed_owner(ctx):
    return [ctx.world_size - 1 - r for r in range(ctx.world_size)]


REVERSED_DP = TransferProtocol(
    "REVERSED_DP",
    _reversed_owner,
    DP_PROTO.collect_ranks,
    DP_PROTO.split,
    DP_PROTO.combine,
    chunked=True,
    pad_batches=True,
)


class ToyTrainer:
    def __init__(self, **config):
        self.config = config


class ToySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    head: str = "lm"
    trainable: bool = True
    seed: int = 0
    lr: float = Field(1e-6, ge=0.0)


@hookimpl
def register_training_engines(register):
    register("toy-train", ToyTrainer, config="hf_toy.plugin:ToySettings")


@hookimpl
def register_rollout_engines(register):
    register("toy-rollout", ToyTrainer)


@hookimpl
def register_protocols(register):
    register(REVERSED_DP)


def toy_advantage(token_level_rewards, response_mask, **inputs):
    scores = token_level_rewards.sum(-1, keepdim=True) * response_mask
    return scores, scores


def toy_loss(log_prob, old_log_prob, advantages, response_mask, config=None, **group):
    loss = -(advantages * log_prob * response_mask).sum() / response_mask.sum().clamp(min=1)
    return loss, {"toy_loss_used": 1.0}


def toy_reward(response, ground_truth, extra):
    return 0.25


@hookimpl
def register_advantage_estimators(register):
    register("toy_adv", toy_advantage, needs_groups=True)


@hookimpl
def register_policy_losses(register):
    register("toy_loss", toy_loss)


@hookimpl
def register_reward_functions(register):
    register("toy_reward", toy_reward, batched=False)
"""


@pytest.fixture(scope="module")
def plugin_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("plugins")
    good, bad = tmp / "site-good", tmp / "site-bad"
    install_plugin_package(tmp, "hf-toy-backend", "hf_toy", TOY_PLUGIN, good)
    install_plugin_package(
        tmp,
        "hf-broken-backend",
        "hf_broken",
        "raise ImportError('this backend is broken on purpose')\n",
        bad,
    )
    return {"good": good, "bad": bad}


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[callable]:
    def add(path: Path) -> None:
        monkeypatch.syspath_prepend(str(path))
        plugins.reset()

    yield add
    plugins.reset()


def _cli(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hf_core.cli", "backends"],
        capture_output=True,
        text=True,
        env=env_with_site(path),
        check=False,
    )


def test_installed_plugin_is_listed_by_the_cli(plugin_dirs: dict[str, Path]) -> None:
    result = _cli(plugin_dirs["good"])
    assert result.returncode == 0, result.stderr
    assert "hf-toy-backend" in result.stdout
    assert "0.3.1" in result.stdout
    assert "toy-train" in result.stdout and "toy-rollout" in result.stdout
    assert "REVERSED_DP" in result.stdout


def test_plugin_failing_on_import_is_reported_and_skipped(plugin_dirs: dict[str, Path]) -> None:
    result = _cli(plugin_dirs["bad"])
    assert result.returncode == 0, result.stderr
    for text in (result.stderr, result.stdout):  # the warning, and the listing's row
        message = " ".join(text.split())
        assert "hf-broken-backend" in message and "broken on purpose" in message
    assert "hf_broken.plugin" in result.stderr


def test_installed_plugin_lists_its_estimator_loss_and_reward(
    plugin_dirs: dict[str, Path],
) -> None:
    result = _cli(plugin_dirs["good"])
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "hf_toy" in line)
    for name in ("hf-toy-backend", "toy_adv", "toy_loss", "toy_reward"):
        assert name in row


def test_registries_expose_plugin_engines(plugin_dirs: dict[str, Path], on_path) -> None:
    on_path(plugin_dirs["good"])
    factory = plugins.get_training_engine("toy-train")
    assert factory(lr=1.0).config == {"lr": 1.0}
    assert plugins.get_rollout_engine("toy-rollout") is factory
    with pytest.raises(
        plugins.UnknownNameError, match=r"unknown training engine .nope.; available"
    ):
        plugins.get_training_engine("nope")


def test_engine_blocks_are_checked_against_the_plugins_settings_model(
    plugin_dirs: dict[str, Path], on_path, tmp_path: Path
) -> None:
    from hf_core.config import ConfigError, TrainerConfig
    from hf_core.trainer.preflight import preflight

    on_path(plugin_dirs["good"])
    assert plugins.get_engine_config("training", "toy-train").__name__ == "ToySettings"
    assert plugins.get_engine_config("rollout", "toy-rollout") is None  # none registered
    base = {
        "model": {"path": str(tmp_path)},
        "reward": {"function": "digits_reverse"},
        "rollout": {"backend": "toy-rollout", "n": 2},
    }

    def config(engine: dict[str, object]) -> TrainerConfig:
        return TrainerConfig.model_validate(
            {**base, "actor": {"backend": "toy-train", "engine": engine}}
        )

    preflight(config({"lr": 0.5}))  # a valid block passes
    for engine, message in [
        ({"lrr": 0.5}, "actor.engine.lrr: unknown key"),
        ({"lr": -1}, "actor.engine.lr: got -1"),
        ({"head": "value"}, "actor.engine.head: set by the trainer"),
    ]:
        with pytest.raises(ConfigError, match=message):
            preflight(config(engine))


def test_a_broken_plugin_is_skipped_and_named_where_a_lookup_misses(
    plugin_dirs: dict[str, Path], on_path
) -> None:
    on_path(plugin_dirs["bad"])
    on_path(plugin_dirs["good"])
    backends = plugins.registry().backends
    assert "broken on purpose" in backends["hf_broken"].error
    assert backends["hf_toy"].error == "" and "toy-train" in backends["hf_toy"].training_engines
    assert plugins.get_training_engine("toy-train")  # the good plugin is unaffected
    from hf_core.algorithms import get_policy_loss

    with pytest.raises(plugins.UnknownNameError, match=r"'hf_broken' from hf-broken-backend"):
        get_policy_loss("only_the_broken_one_had_it")


def test_plugins_provide_estimators_losses_and_rewards_by_name(
    plugin_dirs: dict[str, Path], on_path
) -> None:
    import torch

    from hf_core.algorithms import (
        get_advantage_estimator,
        get_estimator_traits,
        get_policy_loss,
    )
    from hf_core.rewards import get_reward_function

    on_path(plugin_dirs["good"])
    rewards = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    advantages, _ = get_advantage_estimator("toy_adv")(rewards, torch.ones(2, 2))
    assert advantages.tolist() == [[1.0, 1.0], [2.0, 2.0]]
    assert get_estimator_traits("toy_adv").needs_groups
    assert get_policy_loss("toy_loss").__module__ == "hf_toy.plugin"
    assert list(get_reward_function("toy_reward")(["a", "b"], [None, None], {})) == [0.25] * 2
    info = plugins.registry().backends["hf_toy"]
    assert (info.advantage_estimators, info.policy_losses, info.reward_functions) == (
        ["toy_adv"],
        ["toy_loss"],
        ["toy_reward"],
    )


def test_hybridflow_plugins_limits_which_plugins_load(
    plugin_dirs: dict[str, Path], on_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDFLOW_PLUGINS", "hf_toy")
    on_path(plugin_dirs["bad"])
    on_path(plugin_dirs["good"])
    assert "hf_broken" not in plugins.registry().backends  # not even tried
    assert "hf_toy" in plugins.registry().backends
    monkeypatch.setenv("HYBRIDFLOW_PLUGINS", "hf_toy,hf_nope")
    plugins.reset()
    with pytest.raises(plugins.PluginLoadError, match="hf_nope"):
        plugins.registry()


@pytest.mark.usefixtures("ray_cluster")
def test_plugin_protocol_dispatches_through_a_group(plugin_dirs: dict[str, Path], on_path) -> None:
    import torch
    from workers_for_tests import ReversedWorker

    from hf_core.batch import Batch
    from hf_core.runtime import ResourcePool, spawn

    on_path(plugin_dirs["good"])
    pool = ResourcePool([2], name="plugin_proto")
    group = spawn(pool, {"rev": ReversedWorker}, dist_backend=None)["rev"]
    try:
        out = group.who_got(Batch({"x": torch.arange(4)}))
        assert out["x"].tolist() == [2, 3, 0, 1]  # rank 0 got the second chunk
        assert out["rank"].tolist() == [0, 0, 1, 1]
    finally:
        group.shutdown()
        pool.release()
