"""The recipe's ``agent:`` section (multi-turn, tool-using rollouts) and its ``sandbox:``
section (where model-written code runs)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
    function: str | None = Field(
        None,
        description="'package.module:run', an 'async def run(client, sample) -> float | "
        "AgentResult' written against the openai client: each sample runs it against the "
        "policy's OpenAI-compatible endpoint instead of the built-in tool loop (docs/agents.md)",
    )
    timeout_s: float = Field(
        120.0, gt=0, description="agent.function: wall-clock limit of one sample's run"
    )
    model_name: str = Field("policy", description="agent.function: the endpoint's model name")
    host: str = Field(
        "127.0.0.1",
        description="agent.function: the endpoint's address (loopback only by default; any "
        "other address accepts requests from other hosts, still with the run's token)",
    )
    environment: str | None = Field(
        None,
        description="a per-sample environment by registered name (a plugin's "
        "register_environments) or 'package.module:Class', with reset(prompt: str) and "
        "step(turn_text: str) -> str | None (an observation for the model, None: done); "
        "called after turns without tool calls",
    )


class SandboxConfig(BaseModel):
    """Where model-written code runs (the ``python`` tool, the ``code_tests`` reward): the
    local sandbox (:mod:`hf_core.agents.sandbox`) or a remote service speaking SandboxFusion's
    ``run_code`` API (:mod:`hf_core.agents.sandbox_remote`), whose isolation is its own."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["local", "remote"] = Field(
        "local",
        description="local: a sandboxed process on this machine; remote: the service at url",
    )
    url: str | None = Field(
        None,
        description="remote: the service's base URL (e.g. http://127.0.0.1:8080); requests go "
        "to {url}/run_code",
    )
    request_timeout_s: float = Field(
        60.0,
        gt=0,
        description="remote: seconds to wait for the answer to one request (more than the "
        "runs' wall limits, 10 s for the built-ins, plus the service's queueing)",
    )
    connect_retries: int = Field(
        2, ge=0, le=10, description="remote: retries of a request whose connection failed"
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError("must be an http:// or https:// URL, e.g. http://127.0.0.1:8080")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _remote_needs_url(self) -> SandboxConfig:
        if self.kind == "remote" and self.url is None:
            raise ValueError("sandbox.url is required when sandbox.kind is remote")
        return self
