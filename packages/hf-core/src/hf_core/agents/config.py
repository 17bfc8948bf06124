"""The recipe's ``agent:`` section: multi-turn, tool-using rollouts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

QWEN_TOOL_RESPONSE = (
    "\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""The Hermes/Qwen2.5 chat template's rendering of a tool message, followed by the opening of
the next assistant turn (the model's own turn ends with its stop token, ``<|im_end|>``)."""


class AgentConfig(BaseModel):
    """Multi-turn rollouts: the model's turns, tool results between them, a per-sample
    environment; present in a recipe, it replaces single-turn generation."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        description="tools by registered name (built in: calculator, python) or "
        "'package.module:function'",
    )
    max_turns: int = Field(4, ge=1, description="model turns per sample")
    max_total_tokens: int = Field(
        256,
        ge=1,
        description="response tokens per sample over all turns (model and tool tokens); "
        "rollout.max_new_tokens bounds one turn",
    )
    max_tool_calls_per_turn: int = Field(4, ge=1, description="calls run per turn; more: error")
    tool_timeout_s: float = Field(30.0, gt=0, description="wall-clock limit of one tool call")
    tool_response_template: str = Field(
        QWEN_TOOL_RESPONSE,
        description="text of a tool message appended after a model turn ({result} is the "
        "tool's answer); the default is the Hermes/Qwen2.5 chat template's",
    )
    continuous: bool = Field(
        False,
        description="run tools in the background: a sample whose tools answered goes back to "
        "the engine with the next batch, whatever its turn, without waiting for slower "
        "samples' tools (batches then depend on timing: runs are not bit-reproducible)",
    )
    environment: str | None = Field(
        None,
        description="'package.module:Class' of a per-sample environment with "
        "reset(prompt: str) and step(turn_text: str) -> str | None (an observation for the "
        "model, None: done); called after turns without tool calls",
    )
