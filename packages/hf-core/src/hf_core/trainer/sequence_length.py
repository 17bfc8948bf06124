"""Before a run starts: can one sequence (the longest prompt and a full response) be held?

Reasoning RL asks for responses of tens of thousands of tokens.  A response longer than the
model's positions, than the rollout engine's length limit or than one sequence's share of a
KV cache of fixed size used to fail inside the engine at the first rollout (or, for
positions, to generate past what the model was trained on).  Here it is a configuration
error naming the keys; responses cut at ``rollout.max_new_tokens`` are reported every step as
``response_length/truncated_frac``.
"""

from __future__ import annotations

from typing import Any

from hf_core.config import ConfigError, TrainerConfig
from hf_core.engines.capabilities import DeclaresSequenceCapacity
from hf_core.engines.hf_folder import read_model_config
from hf_core.planner.models import from_hf_config
from hf_core.roles.common import rollout_engine_args
from hf_core.trainer.memory_check import validated_engine_settings


def longest_sequence(config: TrainerConfig) -> tuple[int, str]:
    """The most tokens one sequence may reach and the keys that say so."""
    response = config.rollout.max_new_tokens
    prompt = config.data.max_prompt_length
    if prompt is None:
        return response, f"rollout.max_new_tokens {response}"
    return prompt + response, (
        f"data.max_prompt_length {prompt} + rollout.max_new_tokens {response}"
    )


def model_positions(text: dict[str, Any]) -> int | None:
    """The positions a (text) model config covers: ``max_position_embeddings``, times a
    RoPE scaling ``factor`` when it extends them (YaRN, linear, dynamic)."""
    positions = text.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    scaling = text.get("rope_scaling") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if isinstance(factor, (int, float)) and factor > 1:
        original = scaling.get("original_max_position_embeddings") or positions
        return max(positions, int(original * factor))
    return positions


def check_sequence_length(config: TrainerConfig) -> None:
    """Raise :class:`ConfigError` when the longest sequence cannot be generated whole."""
    tokens, keys = longest_sequence(config)
    folder = config.role_model(config.actor)
    hf = read_model_config(folder, key="model.path")
    text = hf.get("text_config") or hf
    positions = model_positions(text)
    if positions is not None and tokens > positions:
        raise ConfigError(
            f"invalid configuration:\n  rollout.max_new_tokens: a sequence may reach "
            f"{tokens} tokens ({keys}), but the model has {positions} positions "
            f"(max_position_embeddings in {folder / 'config.json'}); shorten the prompts or "
            "the responses"
        )
    rollout = config.rollout
    settings = validated_engine_settings(
        "rollout", rollout.backend, lambda: {**rollout_engine_args(config), **rollout.engine}
    )
    if not isinstance(settings, DeclaresSequenceCapacity):
        return
    spec = from_hf_config(hf, name=str(folder))
    capacity = settings.sequence_capacity(2 * spec.num_layers * spec.kv_dim)
    if capacity is not None and tokens > capacity[0]:
        limit, source = capacity
        raise ConfigError(
            f"invalid configuration:\n  rollout.max_new_tokens: a sequence may reach "
            f"{tokens} tokens ({keys}), but the {rollout.backend!r} rollout engine holds at "
            f"most {limit:,} tokens a sequence ({source}); raise that, or shorten the prompts "
            "or the responses"
        )
