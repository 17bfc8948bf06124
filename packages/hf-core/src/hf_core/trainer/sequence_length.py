"""Before a run starts: can one sequence (the longest prompt and a full response) be held?

Reasoning RL asks for responses of tens of thousands of tokens.  A response longer than the
model's positions, than the rollout engine's length limit or than one sequence's share of a
KV cache of fixed size used to fail inside the engine at the first rollout (or, for
positions, to generate past what the model was trained on).  Here it is a configuration
error naming the keys; responses cut at ``rollout.max_new_tokens`` are reported every step as
``response_length/truncated_frac``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_core.config import ConfigError, TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.roles.sequence_capacity import model_positions, sequence_bounds

__all__ = ["LongestSequence", "check_sequence_length", "longest_sequence", "model_positions"]


@dataclass(frozen=True)
class LongestSequence:
    """The most tokens one sequence may reach, and the recipe keys that set it."""

    tokens: int
    key: str
    """The key bounding the response: ``rollout.max_new_tokens`` or, under an agent,
    ``agent.max_total_tokens`` (every turn's tokens)."""
    sum_text: str
    """How the keys add up, e.g. ``data.max_prompt_length 512 + rollout.max_new_tokens 8192``."""

    def refusal(self, bound: str) -> ConfigError:
        return ConfigError(
            f"invalid configuration:\n  {self.key}: a sequence may reach {self.tokens} tokens "
            f"({self.sum_text}), but {bound}; shorten the prompts or the responses"
        )


def longest_sequence(config: TrainerConfig) -> LongestSequence:
    """The prompt (when ``data.max_prompt_length`` bounds it) and the longest response."""
    response, key = config.rollout.max_new_tokens, "rollout.max_new_tokens"
    if config.agent is not None:
        response, key = config.agent.max_total_tokens, "agent.max_total_tokens"
    prompt = config.data.max_prompt_length
    if prompt is None:
        return LongestSequence(response, key, f"{key} {response}")
    return LongestSequence(
        prompt + response, key, f"data.max_prompt_length {prompt} + {key} {response}"
    )


def check_sequence_length(config: TrainerConfig, layout: RunLayout) -> None:
    """Raise :class:`ConfigError` when the longest sequence cannot be generated whole by the
    rollout engine the run's resolved ``layout`` builds."""
    longest = longest_sequence(config)
    bounds = sequence_bounds(config, layout.generation)
    if bounds.positions is not None and longest.tokens > bounds.positions:
        folder = config.role_model(config.actor)
        raise longest.refusal(
            f"the model has {bounds.positions} positions (max_position_embeddings in "
            f"{folder / 'config.json'})"
        )
    if bounds.engine is not None and longest.tokens > bounds.engine[0]:
        limit, source = bounds.engine
        raise longest.refusal(
            f"the {config.rollout.backend!r} rollout engine holds at most {limit:,} tokens a "
            f"sequence ({source}): raise that"
        )
