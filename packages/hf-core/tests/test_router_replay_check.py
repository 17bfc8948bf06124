"""Routing replay before a run starts: a mixture-of-experts actor with replay on needs a
rollout engine that returns the experts it routed to (``DeclaresRoutedExperts``) and a rollout
path that keeps them; otherwise the run stops naming ``algorithm.router_replay``.  Also the
parameter count of a mixture, which the memory check relies on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from hf_core import plugins
from hf_core.config import ConfigError, TrainerConfig
from hf_core.model_shapes import from_hf_config
from hf_core.trainer.preflight import preflight
from hf_testing.tiny import tiny_config
from hf_testing.toy_engines import register_toy_engine

DENSE = tiny_config("qwen2", 128).to_dict()
MOE = tiny_config("qwen3_moe", 128).to_dict()  # 4 experts, top-2, as wide as the hidden size


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="allow")


class ReturnsExperts(BaseModel):
    model_config = ConfigDict(extra="allow")

    def routed_experts_unsupported(self) -> str | None:
        return None


class NotOnThisMachine(BaseModel):
    model_config = ConfigDict(extra="allow")

    def routed_experts_unsupported(self) -> str | None:
        return "the toy engine records experts on GPUs only"


class Plain(BaseModel):
    model_config = ConfigDict(extra="allow")


@pytest.fixture
def engines() -> Iterator[None]:
    plugins.reset()
    register_toy_engine("training", "train-toy", settings=TrainSettings)
    for name, settings in (
        ("replays", ReturnsExperts),
        ("gpu-only", NotOnThisMachine),
        ("plain", Plain),
    ):
        register_toy_engine("rollout", name, settings=settings)
    yield
    plugins.reset()


def _config(folder: Path, shape: dict[str, Any], backend: str, **extra: Any) -> TrainerConfig:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape))
    return TrainerConfig.model_validate(
        {
            "model": {"path": str(folder)},
            "reward": {"function": "digits_reverse"},
            "rollout": {"n": 2, "backend": backend, **extra.pop("rollout", {})},
            "actor": {"backend": "train-toy"},
            **extra,
        }
    )


@pytest.mark.usefixtures("engines")
def test_replay_needs_a_rollout_engine_that_returns_experts(tmp_path: Path) -> None:
    preflight(_config(tmp_path / "moe", MOE, "replays"))  # returns them: fine
    preflight(_config(tmp_path / "dense", DENSE, "plain"))  # dense: nothing to replay
    off = {"algorithm": {"router_replay": "off"}}
    preflight(_config(tmp_path / "moe", MOE, "plain", **off))  # the trainer's router decides
    for backend, why in (
        ("plain", "the 'plain' rollout engine does not return the experts it routes to"),
        ("gpu-only", "the toy engine records experts on GPUs only"),
    ):
        with pytest.raises(ConfigError, match=r"algorithm\.router_replay: rollout") as info:
            preflight(_config(tmp_path / "moe", MOE, backend))
        assert why in str(info.value) and "algorithm.router_replay=off" in str(info.value)


@pytest.mark.usefixtures("engines")
def test_replay_through_agent_loops_is_allowed(tmp_path: Path) -> None:
    """The tool-calling agent loop and agent.function runs (the OpenAI endpoint) carry each
    request's experts; an engine that returns none is still refused."""
    function = {"max_total_tokens": 64, "function": "hf_testing.tool_task:openai_calculator_agent"}
    for n, agent in enumerate(({"max_total_tokens": 64}, function)):
        preflight(_config(tmp_path / f"moe{n}", MOE, "replays", agent=agent))
        with pytest.raises(ConfigError, match="does not return the experts"):
            preflight(_config(tmp_path / f"plain{n}", MOE, "plain", agent=agent))


@pytest.mark.usefixtures("engines")
def test_replay_through_streaming_partial_rollouts_is_allowed(tmp_path: Path) -> None:
    """Streaming requests keep the experts of their fed positions (partial rollouts too)."""
    stream = {"rollout": {"mode": "streaming"}, "placement": {"mode": "standalone"}}
    preflight(_config(tmp_path / "moe", MOE, "replays", **stream))
    with pytest.raises(ConfigError, match="does not return the experts"):
        preflight(_config(tmp_path / "moe", MOE, "plain", **stream))


def test_a_mixture_counts_every_expert_and_computes_its_routed_ones() -> None:
    dense, moe = from_hf_config(DENSE), from_hf_config(MOE)
    assert not dense.is_mixture_of_experts and moe.is_mixture_of_experts
    assert (moe.num_experts, moe.experts_per_token) == (4, 2)
    h, layers, width = 64, 2, moe.moe_intermediate_size
    mlp_dense = 3 * h * dense.intermediate_size
    mlp_stored = 4 * 3 * h * width + h * 4  # four experts and the router
    mlp_active = 2 * 3 * h * width + h * 4  # two experts a token, and the router
    assert moe.num_params - dense.num_params == layers * (mlp_stored - mlp_dense)
    assert moe.matmul_params - dense.matmul_params == layers * (mlp_active - mlp_dense)
    mixtral = from_hf_config({**DENSE, "num_local_experts": 4, "num_experts_per_tok": 2})
    assert mixtral.moe_intermediate_size == 128  # Mixtral's experts are intermediate_size wide


def test_off_written_bare_in_yaml_or_on_the_command_line_means_off(tmp_path: Path) -> None:
    from hf_core.config import load_config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("algorithm:\n  router_replay: off\n")  # YAML 1.1 reads a boolean
    base = [f"model.path={tmp_path}", "reward.function=digits_reverse"]
    assert load_config(TrainerConfig, recipe, base).algorithm.router_replay == "off"
    config = load_config(TrainerConfig, None, [*base, "algorithm.router_replay=off"])
    assert config.algorithm.router_replay == "off"
