"""Agent code written for a chat API, run unchanged as RL rollouts (``agent.function``).

The recipe names ``package.module:run``, an ``async def run(client, sample) -> float |
AgentResult``.  For each sample of a step the framework opens a trajectory on the policy
endpoint (:mod:`hf_core.serving`), gives ``run`` an ``openai.AsyncOpenAI`` client bound to it
and the sample's dataset fields (``prompt`` is the prompt's text), and runs every sample's
``run`` concurrently.  Whatever the agent asks of the client becomes one token-exact sequence:
its first request's rendered messages are the prompt, sampled tokens are trained on, inserted
messages (tool results, follow-ups) are context only.  The function's return value is the
sample's reward.

A function that raises, runs past ``agent.timeout_s`` or returns something that is not a
finite number is a failed sample: reward 0, nothing trained on (its response mask is empty),
counted in ``agent/failed`` and ``agent/timed_out``.  The step goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hf_core.agents.config import AgentConfig
from hf_core.batch import Batch
from hf_core.engines import token_ids
from hf_core.engines.decoding import left_padded, strip_left_padding
from hf_core.engines.rollout import RolloutEngine, SamplingParams, assemble_rollout
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, routing_batch
from hf_core.errors import ConfigError
from hf_core.imports import resolve
from hf_core.serving import (
    ChatRenderer,
    EndpointLimits,
    EndpointServer,
    EngineBatcher,
    PolicyEndpoint,
    Trajectory,
    TrajectoryTicket,
)


@dataclass
class AgentResult:
    """What an agent function may return instead of a bare reward."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to keep with the sample: the batch's ``agent_info`` column, which a
    ``reward.function`` receives in its ``extras``."""


@dataclass
class _Outcome:
    reward: float = 0.0
    status: str = "ok"
    """ok, failed (raised or returned garbage) or timed_out."""
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)


AgentFunction = Callable[[Any, dict[str, Any]], Any]
log = logging.getLogger(__name__)


def load_agent_function(spec: str, key: str = "agent.function") -> AgentFunction:
    """The coroutine function named ``package.module:function``; agent functions have no
    registry, so a recipe names them by path (:func:`hf_core.imports.resolve`)."""
    found = resolve(
        spec,
        key=key,
        error=ConfigError,
        accept=inspect.iscoroutinefunction,
        expected="an 'async def run(client, sample)' function",
        form="'package.module:function'",
    )
    return found.value  # type: ignore[no-any-return]


class FunctionAgentLoop:
    """Runs ``agent.function`` for every sample against the policy endpoint."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        config: AgentConfig,
        function: AgentFunction | None = None,
        version: Callable[[], int] = lambda: 0,
        capacity: int | None = None,
    ) -> None:
        """``function``: what runs each sample (default: ``agent.function``; an environment's
        episode runner otherwise); ``capacity``: the most tokens the rollout engine holds in
        one sequence, where the caller knows it (the endpoint then refuses longer contexts
        before they reach it)."""
        if function is None:
            if config.function is None:
                raise ConfigError("agent.function is not set")
            function = load_agent_function(config.function)
        self.function = function
        self.tokenizer, self.config = tokenizer, config
        if tokenizer.pad_token_id is None:
            raise ConfigError("agent: the tokenizer has no pad token")
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.renderer = ChatRenderer(tokenizer, token_ids(tokenizer.eos_token_id))
        self.batcher = EngineBatcher(engine, self.pad_token_id, version)
        self.endpoint = PolicyEndpoint(
            self.batcher,
            self.renderer,
            SamplingParams(),
            EndpointLimits(
                max_requests=config.max_turns,
                max_total_tokens=config.max_total_tokens,
                max_new_tokens=config.max_total_tokens,
                capacity=capacity,
            ),
        )
        self.server = EndpointServer(self.endpoint, model_name=config.model_name, host=config.host)

    def close(self) -> None:
        self.server.close()
        self.batcher.close()

    # ------------------------------------------------------------- generate
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Like :meth:`RolloutEngine.generate`: ``params.n`` agent runs per prompt
        (consecutive rows); ``params.max_new_tokens`` bounds each completion."""
        prompts = prompts.repeat_interleave(params.n) if params.n > 1 else prompts
        rows = strip_left_padding(prompts["input_ids"], prompts["attention_mask"])
        self.endpoint.sampling = params.model_copy(update={"n": 1})
        self.endpoint.limits = dataclasses.replace(
            self.endpoint.limits, max_new_tokens=params.max_new_tokens
        )
        samples = [self._sample(prompts, i, row) for i, row in enumerate(rows)]
        tickets = [self.endpoint.open() for _ in rows]  # ids and keys no agent can guess
        try:
            outcomes = asyncio.run(self._run_all(tickets, samples))
        finally:  # taken even when the step fails, so none is left open
            trajectories = [self.endpoint.take(t.id) for t in tickets]
        failed = [o for o in outcomes if o.status != "ok"]
        if failed:
            log.warning(
                "%d of %d agent runs failed (masked out of the loss); first: %s: %s",
                len(failed),
                len(outcomes),
                failed[0].status,
                failed[0].error,
            )
        width = max(prompts["input_ids"].shape[1], self._prompt_limit())
        return self._assemble(rows, trajectories, outcomes, params.temperature, width)

    def _prompt_limit(self) -> int:
        """The most tokens a trajectory's prompt may have (the endpoint refuses longer)."""
        limits = self.endpoint.limits
        return limits.max_prompt_tokens or limits.max_total_tokens

    def _sample(self, prompts: Batch, index: int, prompt_ids: list[int]) -> dict[str, Any]:
        """The dataset fields of row ``index`` for the agent function."""
        sample: dict[str, Any] = {"prompt": self.tokenizer.decode(prompt_ids)}
        for key in prompts.non_tensors:
            value = prompts[key][index]
            sample[key] = value.item() if isinstance(value, np.generic) else value
        return sample

    async def _run_all(
        self, tickets: list[TrajectoryTicket], samples: list[dict[str, Any]]
    ) -> list[_Outcome]:
        runs = [self._run(t, s) for t, s in zip(tickets, samples, strict=True)]
        return list(await asyncio.gather(*runs))

    async def _run(self, ticket: TrajectoryTicket, sample: dict[str, Any]) -> _Outcome:
        client = self.server.client(ticket, max_retries=0, timeout=self.config.timeout_s)
        try:
            async with client:
                result = await asyncio.wait_for(
                    self.function(client, sample), timeout=self.config.timeout_s
                )
        except TimeoutError:
            return _Outcome(status="timed_out", error=f"over {self.config.timeout_s} s")
        except Exception as exc:  # the agent's own failure: recorded, the step goes on
            return _Outcome(status="failed", error=f"{type(exc).__name__}: {exc}")
        finally:  # the run is over: its trajectory takes no more requests
            self.endpoint.finish(ticket.id)
        info: dict[str, Any] = {}
        value: Any = result
        if isinstance(result, AgentResult):
            value, info = result.reward, dict(result.info)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = type(value).__name__
            return _Outcome(status="failed", error=f"returned {kind}, not a reward")
        if not math.isfinite(float(value)):
            return _Outcome(status="failed", error=f"returned {value}")
        return _Outcome(reward=float(value), info=info)

    # ------------------------------------------------------------- assemble
    def _assemble(
        self,
        rows: list[list[int]],
        trajectories: list[Trajectory | None],
        outcomes: list[_Outcome],
        temperature: float,
        prompt_width: int,
    ) -> Batch:
        """The rollout batch: each trajectory's prompt and tokens, only successful samples'
        sampled tokens in the loss.  Prompts are left-padded to ``prompt_width``, the same on
        every rank of the step whatever its agents sent (a trajectory's prompt is what its
        first request rendered, not the dataset row), so the ranks' batches join."""
        width = self.config.max_total_tokens
        size = len(rows)
        prompts, kept = [], []
        for row, trajectory, outcome in zip(rows, trajectories, outcomes, strict=True):
            usable = outcome.status == "ok" and trajectory is not None and trajectory.prompt
            kept.append(trajectory if usable else None)
            prompts.append(trajectory.prompt if usable and trajectory else row)
        responses = torch.full((size, width), self.pad_token_id, dtype=torch.long)
        real = torch.zeros((size, width), dtype=torch.long)
        sampled = torch.zeros((size, width), dtype=torch.long)
        log_probs = torch.zeros((size, width), dtype=torch.float32)
        for i, trajectory in enumerate(kept):
            if trajectory is None:
                continue
            n = min(len(trajectory.tokens), width)
            responses[i, :n] = torch.tensor(trajectory.tokens[:n], dtype=torch.long)
            real[i, :n] = 1
            sampled[i, :n] = torch.tensor(trajectory.sampled[:n], dtype=torch.long)
            log_probs[i, :n] = torch.tensor(trajectory.log_probs[:n], dtype=torch.float32)
        out = assemble_rollout(
            left_padded(prompts, self.pad_token_id, prompt_width),
            responses,
            real,
            log_probs,
            temperature,
        )
        out["response_mask"] = sampled
        recorded = [
            (t.routed, len(t.prompt), min(len(t.tokens), width)) if t else (None, 0, 0)
            for t in kept
        ]
        routed = routing_batch(recorded, out["input_ids"].shape[1] - width, width)
        if routed is not None:
            out[ROUTED_EXPERTS_KEY] = routed
        out["agent_reward"] = torch.tensor([o.reward for o in outcomes], dtype=torch.float32)
        out["agent_failed"] = torch.tensor([o.status == "failed" for o in outcomes])
        out["agent_timed_out"] = torch.tensor([o.status == "timed_out" for o in outcomes])
        out["agent_turns"] = torch.tensor([t.requests if t else 0 for t in trajectories])
        out["agent_tool_calls"] = torch.tensor([_tool_calls(t) for t in kept])
        out["agent_tool_errors"] = torch.zeros(size, dtype=torch.long)
        out["agent_tool_timeouts"] = torch.zeros(size, dtype=torch.long)
        out["trajectory"] = np.array(
            [self.tokenizer.decode(t.tokens) if t else "" for t in kept], dtype=object
        )
        errors = np.empty(size, dtype=object)
        errors[:] = [o.error for o in outcomes]
        out["agent_error"] = errors
        infos = np.empty(size, dtype=object)
        infos[:] = [o.info for o in outcomes]
        out["agent_info"] = infos
        return out


def _tool_calls(trajectory: Trajectory | None) -> int:
    """Tool calls the policy made in a trajectory (assistant messages' ``tool_calls``)."""
    if trajectory is None:
        return 0
    return sum(
        len(m.get("tool_calls") or []) for m in trajectory.messages if m.get("role") == "assistant"
    )
