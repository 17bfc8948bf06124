"""What the endpoint does with a request: trajectories, sampling, OpenAI-shaped answers.

The HTTP layer (:mod:`hf_core.serving.app`) parses and checks requests; this class owns the
trajectories (:mod:`hf_core.serving.trajectories`) and hands completions to the engine thread
(:mod:`hf_core.serving.batching`).  Limits per trajectory: ``max_requests`` completions and
``max_total_tokens`` tokens after the prompt; a completion is cut to the room left.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hf_core.engines.rollout import SamplingParams
from hf_core.serving.batching import EngineBatcher
from hf_core.serving.trajectories import (
    ChatRenderer,
    ConversationEdited,
    Trajectory,
    TrajectoryLimit,
)


@dataclass(frozen=True)
class EndpointLimits:
    max_requests: int = 8
    """Completions per trajectory (agent turns)."""
    max_total_tokens: int = 1024
    """Tokens per trajectory after its prompt (sampled and inserted)."""
    max_new_tokens: int = 256
    """Tokens per completion (a request's max_tokens may only lower it)."""


class PolicyEndpoint:
    """Serves chat and text completions from the policy, one token sequence per trajectory."""

    def __init__(
        self,
        batcher: EngineBatcher,
        renderer: ChatRenderer,
        sampling: SamplingParams,
        limits: EndpointLimits,
    ) -> None:
        """``sampling``: the run's sampling parameters (a request may set temperature, top_p
        and max_tokens; everything else, seed included, is the run's)."""
        self.batcher, self.renderer = batcher, renderer
        self.sampling, self.limits = sampling, limits
        self.trajectories: dict[str, Trajectory] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ trajectories
    def open(self, trajectory_id: str) -> Trajectory:
        """The trajectory ``trajectory_id`` (created empty on first use)."""
        with self._lock:
            return self.trajectories.setdefault(trajectory_id, Trajectory())

    def take(self, trajectory_id: str) -> Trajectory | None:
        """Remove and return a finished trajectory (None if it never made a request)."""
        with self._lock:
            return self.trajectories.pop(trajectory_id, None)

    # ----------------------------------------------------------------- requests
    async def chat(self, trajectory_id: str, body: dict[str, Any]) -> dict[str, Any]:
        trajectory = self.open(trajectory_id)
        async with trajectory.lock:  # one request of a trajectory at a time
            self._count(trajectory)
            self.renderer.extend(trajectory, list(body["messages"]), body.get("tools"))
            completion = await self._complete(trajectory, body)
            text = self.renderer.tokenizer.decode(completion.tokens)
            message, finish = self.renderer.assistant_message(text)
            if finish == "stop" and self._cut(trajectory, completion.tokens):
                finish = "length"
            trajectory.messages.append(message)
        choice = {"index": 0, "message": message, "finish_reason": finish}
        choice["logprobs"] = self._logprobs(completion.tokens, completion.log_probs)
        return self._answer("chat.completion", body, trajectory, choice, completion)

    async def text(self, trajectory_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/completions``: the prompt (text or token ids) must extend the trajectory's
        tokens; the new part is appended with loss mask 0."""
        trajectory = self.open(trajectory_id)
        async with trajectory.lock:
            self._count(trajectory)
            prompt = body["prompt"]
            ids = list(prompt) if isinstance(prompt, list) else self.renderer.encode(prompt)
            context = trajectory.context
            if not trajectory.prompt:
                trajectory.prompt = ids
            elif ids[: len(context)] == context:
                trajectory.append(ids[len(context) :], None)
            else:
                raise ConversationEdited(
                    "the prompt does not extend the trajectory's tokens; start a new trajectory"
                )
            completion = await self._complete(trajectory, body)
            finish = "length" if self._cut(trajectory, completion.tokens) else "stop"
        choice = {
            "index": 0,
            "text": self.renderer.tokenizer.decode(completion.tokens),
            "finish_reason": finish,
            "logprobs": self._logprobs(completion.tokens, completion.log_probs),
        }
        return self._answer("text_completion", body, trajectory, choice, completion)

    def _count(self, trajectory: Trajectory) -> None:
        if trajectory.requests >= self.limits.max_requests:
            raise TrajectoryLimit(
                f"the trajectory made its {self.limits.max_requests} requests (agent.max_turns)"
            )
        if len(trajectory.tokens) >= self.limits.max_total_tokens:
            raise TrajectoryLimit(
                f"the trajectory holds {self.limits.max_total_tokens} tokens "
                "(agent.max_total_tokens)"
            )
        trajectory.requests += 1

    async def _complete(self, trajectory: Trajectory, body: dict[str, Any]) -> Any:
        room = self.limits.max_total_tokens - len(trajectory.tokens)
        if room <= 0:
            raise TrajectoryLimit("the inserted messages filled the trajectory's token budget")
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        update: dict[str, Any] = {
            "n": 1,
            "max_new_tokens": min(self.limits.max_new_tokens, room, asked or room),
        }
        for key, name in (("temperature", "temperature"), ("top_p", "top_p")):
            if body.get(key) is not None:
                update[name] = body[key]
        params = self.sampling.model_copy(update=update)
        future = self.batcher.submit(trajectory.context, params)
        completion = await asyncio.wrap_future(future)
        trajectory.append(completion.tokens, completion.log_probs, completion.version)
        return completion

    def _cut(self, trajectory: Trajectory, tokens: list[int]) -> bool:
        """Whether the completion ended without a stop token (at a token limit)."""
        stops = set(self.sampling.stop_token_ids) | self.renderer.stop_ids
        return not tokens or tokens[-1] not in stops

    def _logprobs(self, tokens: list[int], log_probs: list[float]) -> dict[str, Any]:
        decode = self.renderer.tokenizer.decode
        return {
            "content": [
                {"token": decode([t]), "logprob": lp, "token_id": t}
                for t, lp in zip(tokens, log_probs, strict=True)
            ]
        }

    def _answer(
        self,
        kind: str,
        body: dict[str, Any],
        trajectory: Trajectory,
        choice: dict[str, Any],
        completion: Any,
    ) -> dict[str, Any]:
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:16]}",
            "object": kind,
            "created": int(time.time()),
            "model": body["model"],
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(trajectory.context) - len(completion.tokens),
                "completion_tokens": len(completion.tokens),
                "total_tokens": len(trajectory.context),
            },
            "policy_version": completion.version,
        }
