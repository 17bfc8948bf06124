"""What the endpoint does with a request: trajectories, sampling, OpenAI-shaped answers.

The HTTP layer (:mod:`hf_core.serving.app`) parses and checks requests; this class owns the
trajectories (:mod:`hf_core.serving.trajectories`) and hands completions to the engine thread
(:mod:`hf_core.serving.batching`).

Trajectories are opened by the framework, one per agent run (:meth:`PolicyEndpoint.open`),
never by a request: each gets an id and a key from ``secrets.token_urlsafe``, so no agent can
guess a sibling's, and a request acts on a trajectory only with that trajectory's key (or the
server's own token).  A request naming an unknown trajectory, one of another agent run, or
one whose run is over (:meth:`PolicyEndpoint.finish`) is refused and changes nothing.  At most
``max_trajectories`` are held: opening past it evicts the oldest finished one that was never
taken, and fails (:class:`TooManyTrajectories`) when all are live.

Limits per trajectory: ``max_requests`` completions and ``max_total_tokens`` tokens after the
prompt; a prompt of at most ``max_prompt_tokens`` (by default ``max_total_tokens``); a context
the engine can hold (``capacity``); token ids inside the vocabulary.  All are checked before a
request reaches the engine, so a bad request never fails the others batched with it; a
completion is cut to the room left.  A request changes its trajectory only once the engine has
answered: refused or failed, it leaves the trajectory as it was.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from hf_core.engines.rollout import SamplingParams
from hf_core.engines.routed_experts import keep_first_routing
from hf_core.serving.batching import Completion, EngineBatcher
from hf_core.serving.trajectories import (
    ChatRenderer,
    ConversationEdited,
    InvalidPrompt,
    PromptTooLong,
    Trajectory,
    TrajectoryLimit,
)

MAX_TRAJECTORIES = 1 << 16
"""Trajectories held at once by default: far above one step's samples (the framework opens one
per sample and takes them back at the end of the step), so only leaked ones ever reach it."""


@dataclass(frozen=True)
class EndpointLimits:
    max_requests: int = 8
    """Completions per trajectory (agent turns)."""
    max_total_tokens: int = 1024
    """Tokens per trajectory after its prompt (sampled and inserted)."""
    max_new_tokens: int = 256
    """Tokens per completion (a request's max_tokens may only lower it)."""
    max_prompt_tokens: int | None = None
    """Tokens a trajectory's prompt may have (None: ``max_total_tokens``)."""
    capacity: int | None = None
    """The most tokens the engine holds in one sequence, prompt and completion (None: not
    known; the other limits still bound a sequence)."""
    vocab_size: int | None = None
    """Token ids a prompt may hold: ``0 <= id < vocab_size`` (None: the tokenizer's size)."""


@dataclass(frozen=True)
class TrajectoryTicket:
    """What one agent run gets: its trajectory's id (in its base URL) and the key (its API key)
    that alone may act on it."""

    id: str
    key: str = field(repr=False)


class UnknownTrajectory(LookupError):
    """No open trajectory has that id (never opened, taken, or evicted)."""


class ForeignTrajectory(Exception):
    """The request's key belongs to another agent run's trajectory."""


class TrajectoryClosed(Exception):
    """The agent run of the trajectory is over; it takes no more requests."""


class TooManyTrajectories(RuntimeError):
    """The endpoint holds ``max_trajectories`` live trajectories; none can be evicted."""


def _digest(key: str) -> bytes:
    """Keys are looked up by hash, so a lookup's timing says nothing about a key's bytes."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _shown(name: str) -> str:
    """A client-chosen trajectory name, shortened for an error message."""
    return repr(name if len(name) <= 48 else name[:48] + "...")


class PolicyEndpoint:
    """Serves chat and text completions from the policy, one token sequence per trajectory."""

    def __init__(
        self,
        batcher: EngineBatcher,
        renderer: ChatRenderer,
        sampling: SamplingParams,
        limits: EndpointLimits,
        *,
        max_trajectories: int = MAX_TRAJECTORIES,
    ) -> None:
        """``sampling``: the run's sampling parameters (a request may set temperature, top_p
        and max_tokens; everything else, seed included, is the run's)."""
        if max_trajectories < 1:
            raise ValueError(f"max_trajectories must be >= 1, got {max_trajectories}")
        self.batcher, self.renderer = batcher, renderer
        self.sampling, self.limits = sampling, limits
        self.max_trajectories = max_trajectories
        self.trajectories: dict[str, Trajectory] = {}
        """The open trajectories, live and finished, by id."""
        self._owner: dict[bytes, str] = {}
        """Trajectory id by the hash of its key."""
        self._key: dict[str, bytes] = {}
        self._finished: dict[str, None] = {}
        """Finished trajectories not taken yet, oldest first (the eviction order)."""
        self._lock = threading.Lock()

    # ------------------------------------------------------------ trajectories
    def open(self) -> TrajectoryTicket:
        """A new, empty trajectory for one agent run, with an id and a key nobody can guess."""
        with self._lock:
            while len(self.trajectories) >= self.max_trajectories and self._finished:
                self._drop(next(iter(self._finished)))
            if len(self.trajectories) >= self.max_trajectories:
                raise TooManyTrajectories(
                    f"{len(self.trajectories)} trajectories are open and none has finished: "
                    f"the endpoint holds at most {self.max_trajectories} (max_trajectories); "
                    "finish or take some first"
                )
            ticket = TrajectoryTicket(secrets.token_urlsafe(16), secrets.token_urlsafe(24))
            digest = _digest(ticket.key)
            self.trajectories[ticket.id] = Trajectory()
            self._owner[digest], self._key[ticket.id] = ticket.id, digest
            return ticket

    def finish(self, trajectory_id: str) -> None:
        """The agent run is over: its trajectory takes no more requests and may be evicted
        once the endpoint is full, if nobody takes it first."""
        with self._lock:
            if trajectory_id in self.trajectories:
                self._finished[trajectory_id] = None

    def take(self, trajectory_id: str) -> Trajectory | None:
        """Remove and return a trajectory, finished or not (None if it is not open); its key
        stops working."""
        with self._lock:
            return self._drop(trajectory_id)

    def _drop(self, trajectory_id: str) -> Trajectory | None:
        self._finished.pop(trajectory_id, None)
        digest = self._key.pop(trajectory_id, None)
        if digest is not None:
            self._owner.pop(digest, None)
        return self.trajectories.pop(trajectory_id, None)

    def knows(self, key: str) -> bool:
        """Whether ``key`` is the key of an open trajectory."""
        with self._lock:
            return _digest(key) in self._owner

    def resolve(self, named: str | None, key: str, *, admin: bool = False) -> str:
        """The trajectory a request acts on: the one it names, else its key's.  Without
        ``admin`` (the server's token) it must be the key's own."""
        with self._lock:
            owner = self._owner.get(_digest(key))
            target = named or owner
            if target is None:
                raise UnknownTrajectory(
                    "name the trajectory: /t/<id>/v1/..., X-Trajectory-Id or 'user'"
                )
            if target not in self.trajectories:
                raise UnknownTrajectory(
                    f"no open trajectory {_shown(target)}: trajectories are opened by the "
                    "framework, one per agent run, and close when the run's results are taken"
                )
            if not admin and owner != target:
                raise ForeignTrajectory(
                    f"trajectory {_shown(target)} belongs to another agent run; a client may "
                    "only use the trajectory its key was issued for"
                )
            return target

    def _live(self, trajectory_id: str) -> Trajectory:
        """The trajectory, if it still takes requests (a commit checks again holding
        ``_lock``, so a trajectory finished or taken meanwhile is left alone)."""
        trajectory = self.trajectories.get(trajectory_id)
        if trajectory is None:
            raise UnknownTrajectory(f"no open trajectory {_shown(trajectory_id)}")
        if trajectory_id in self._finished:
            raise TrajectoryClosed(
                f"the agent run of trajectory {_shown(trajectory_id)} is over; it takes no more "
                "requests"
            )
        return trajectory

    # ----------------------------------------------------------------- requests
    async def chat(self, trajectory_id: str, body: dict[str, Any]) -> dict[str, Any]:
        trajectory = self._live(trajectory_id)
        async with trajectory.lock:  # one request of a trajectory at a time
            self._live(trajectory_id)
            self._check_turns(trajectory)
            if trajectory.prompt and not trajectory.messages:
                raise ConversationEdited(
                    "the trajectory was started with /v1/completions; continue it there"
                )
            messages, tools = list(body["messages"]), body.get("tools")
            ids = self.renderer.continuation(trajectory, messages, tools)
            context, params = self._admit(trajectory, ids, body)
            completion = await self._generate(context, params)
            text = self.renderer.tokenizer.decode(completion.tokens)
            message, finish = self.renderer.assistant_message(text)
            if finish == "stop" and self._cut(completion.tokens):
                finish = "length"
            with self._lock:  # the run may have finished while the engine sampled
                self._live(trajectory_id)
                self.renderer.commit(trajectory, messages, tools, ids)
                self._record(trajectory, completion)
                trajectory.messages.append(message)
        choice = {"index": 0, "message": message, "finish_reason": finish}
        choice["logprobs"] = self._logprobs(completion.tokens, completion.log_probs)
        return self._answer("chat.completion", body, trajectory, choice, completion)

    async def text(self, trajectory_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/completions``: the prompt (text or token ids) must extend the trajectory's
        tokens; the new part is appended with loss mask 0."""
        trajectory = self._live(trajectory_id)
        prompt = body["prompt"]
        ids = self._checked_ids(prompt) if isinstance(prompt, list) else self._encoded(prompt)
        async with trajectory.lock:
            self._live(trajectory_id)
            self._check_turns(trajectory)
            if trajectory.messages:
                raise ConversationEdited(
                    "the trajectory is a chat conversation; continue it with /v1/chat/completions"
                )
            context = trajectory.context
            if not trajectory.prompt:
                new = ids
            elif ids[: len(context)] == context:
                new = ids[len(context) :]
            else:
                raise ConversationEdited(
                    "the prompt does not extend the trajectory's tokens; a trajectory cannot "
                    "be edited"
                )
            full, params = self._admit(trajectory, new, body)
            completion = await self._generate(full, params)
            finish = "length" if self._cut(completion.tokens) else "stop"
            with self._lock:
                self._live(trajectory_id)
                if not trajectory.prompt:
                    trajectory.prompt = list(new)
                else:
                    trajectory.append(new, None)
                self._record(trajectory, completion)
        choice = {
            "index": 0,
            "text": self.renderer.tokenizer.decode(completion.tokens),
            "finish_reason": finish,
            "logprobs": self._logprobs(completion.tokens, completion.log_probs),
        }
        return self._answer("text_completion", body, trajectory, choice, completion)

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold are below this."""
        size = self.limits.vocab_size
        return len(self.renderer.tokenizer) if size is None else size

    def _checked_ids(self, ids: list[int]) -> list[int]:
        """Token ids from a client, each inside the vocabulary (an id the engine cannot embed
        would fail the whole engine call, every trajectory batched with it included)."""
        vocab = self.vocab_size
        for position, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise InvalidPrompt(
                    f"prompt token {position} is id {token}, outside the vocabulary: ids must be "
                    f"0 <= id < {vocab} (the vocabulary size)"
                )
        return list(ids)

    def _encoded(self, text: str) -> list[int]:
        return self._checked_ids(self.renderer.encode(text))

    def _check_turns(self, trajectory: Trajectory) -> None:
        if trajectory.requests >= self.limits.max_requests:
            raise TrajectoryLimit(
                f"the trajectory made its {self.limits.max_requests} requests (agent.max_turns)"
            )
        if len(trajectory.tokens) >= self.limits.max_total_tokens:
            raise TrajectoryLimit(
                f"the trajectory holds {self.limits.max_total_tokens} tokens "
                "(agent.max_total_tokens)"
            )

    def _admit(
        self, trajectory: Trajectory, ids: list[int], body: dict[str, Any]
    ) -> tuple[list[int], SamplingParams]:
        """The context ``ids`` make and the sampling parameters of its completion, once the
        prompt, the trajectory's budget and the engine's capacity allow them."""
        limits = self.limits
        if not trajectory.prompt:
            if not ids:
                raise InvalidPrompt("the prompt is empty")
            limit = limits.max_prompt_tokens
            name = "agent.max_total_tokens" if limit is None else "max_prompt_tokens"
            limit = limits.max_total_tokens if limit is None else limit
            if len(ids) > limit:
                raise PromptTooLong(
                    f"the prompt has {len(ids)} tokens; a trajectory's prompt may have at most "
                    f"{limit} ({name})"
                )
            context, used = list(ids), 0
        else:
            used = len(trajectory.tokens) + len(ids)
            if used >= limits.max_total_tokens:
                raise TrajectoryLimit(
                    f"the inserted messages ({len(ids)} tokens) would fill the trajectory's "
                    f"budget of {limits.max_total_tokens} tokens (agent.max_total_tokens)"
                )
            context = trajectory.context + ids
        room = limits.max_total_tokens - used
        if limits.capacity is not None:
            if len(context) >= limits.capacity:
                raise PromptTooLong(
                    f"the context would have {len(context)} tokens; the engine holds at most "
                    f"{limits.capacity} tokens a sequence (its capacity), one of them sampled"
                )
            room = min(room, limits.capacity - len(context))
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        update: dict[str, Any] = {
            "n": 1,
            "max_new_tokens": min(limits.max_new_tokens, room, asked or room),
        }
        for key in ("temperature", "top_p"):
            if body.get(key) is not None:
                update[key] = body[key]
        return context, self.sampling.model_copy(update=update)

    async def _generate(self, context: list[int], params: SamplingParams) -> Completion:
        return await asyncio.wrap_future(self.batcher.submit(context, params))

    @staticmethod
    def _record(trajectory: Trajectory, completion: Completion) -> None:
        trajectory.append(completion.tokens, completion.log_probs, completion.version)
        trajectory.requests += 1
        if completion.routed is not None:
            trajectory.routed = keep_first_routing(
                trajectory.routed, completion.routed, "trajectory"
            )

    def _cut(self, tokens: list[int]) -> bool:
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
        completion: Completion,
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
