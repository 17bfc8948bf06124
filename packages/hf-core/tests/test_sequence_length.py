"""Before a run: a sequence the model or the rollout engine cannot hold is a config error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from hf_core import plugins
from hf_core.config import ConfigError, TrainerConfig
from hf_core.config.layout import resolve_layout
from hf_core.trainer.sequence_length import check_sequence_length, model_positions
from hf_testing.toy_engines import register_toy_engine

MODEL = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 4096,
}


def _config(tmp_path: Path, model: dict, **sections: dict) -> TrainerConfig:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model))
    doc: dict = {"model": {"path": str(folder)}, "reward": {"function": "digits_reverse"}}
    doc.update(sections)
    return TrainerConfig.model_validate(doc)


def _check(config: TrainerConfig) -> None:
    check_sequence_length(config, resolve_layout(config))


def test_responses_past_the_models_positions_are_refused(tmp_path: Path) -> None:
    fits = {"data": {"max_prompt_length": 96}, "rollout": {"max_new_tokens": 4000}}
    _check(_config(tmp_path, MODEL, **fits))
    over = {"data": {"max_prompt_length": 97}, "rollout": {"max_new_tokens": 4000}}
    with pytest.raises(
        ConfigError,
        match=r"rollout.max_new_tokens: a sequence may reach 4097 tokens \(data.max_prompt_length "
        r"97 \+ rollout.max_new_tokens 4000\), but the model has 4096 positions "
        r"\(max_position_embeddings in .*config.json",
    ):
        _check(_config(tmp_path, MODEL, **over))
    agent = {"agent": {"max_total_tokens": 5000}, "rollout": {"max_new_tokens": 64}}
    with pytest.raises(ConfigError, match=r"agent.max_total_tokens: a sequence may reach 5000"):
        _check(_config(tmp_path, MODEL, **agent))  # every turn's tokens count
    scaled = {**MODEL, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    long = {"rollout": {"max_new_tokens": 16000}}
    assert model_positions(scaled) == 16384
    _check(_config(tmp_path, scaled, **long))


class _FixedCache(BaseModel):
    """A rollout engine's settings with a KV cache of fixed size (what vLLM on CPU has)."""

    model_config = ConfigDict(extra="forbid")
    model_path: str
    cache_bytes: int = 2**20

    def sequence_capacity(self, kv_elements_per_token: int) -> tuple[int, str]:
        return self.cache_bytes // (4 * kv_elements_per_token), "the toy KV cache (cache_bytes)"


@pytest.fixture
def fixed_cache_engine() -> Iterator[str]:
    plugins.reset()
    register_toy_engine("rollout", "cache-toy", settings=_FixedCache)
    yield "cache-toy"
    plugins.reset()


def test_a_response_the_rollout_engines_kv_cache_cannot_hold_is_refused(
    tmp_path: Path, fixed_cache_engine: str
) -> None:
    # K and V of 2 layers x 2 heads x 16 dims in float32: 512 bytes a token, 2,048 in 1 MiB
    rollout = {"backend": fixed_cache_engine, "max_new_tokens": 2048}
    _check(_config(tmp_path, MODEL, rollout=rollout))
    with pytest.raises(
        ConfigError,
        match=r"may reach 2049 tokens \(rollout.max_new_tokens 2049\), but the 'cache-toy' "
        r"rollout engine holds at most 2,048 tokens a sequence \(the toy KV cache",
    ):
        _check(_config(tmp_path, MODEL, rollout={**rollout, "max_new_tokens": 2049}))
