"""An OpenEnv environment server as a run's environment (``env: {kind: openenv, url: ...}``):
each sample is one episode, the policy talking to the server turn by turn, the server's
rewards and ``done`` ending and scoring it.

Install with ``pip install 'hf-core[openenv]'`` (the ``websockets`` client; the server is the
user's, written with ``openenv-core`` and started however they start it: ``uvicorn``, docker,
``openenv serve``).  docs/environments.md has a worked example.

**The episode.**  One WebSocket session (``<url>/ws``) per sample: OpenEnv keeps an episode's
state per socket, its plain HTTP ``/reset`` and ``/step`` build a fresh environment for every
call and cannot hold one.  ``reset`` (with the record's seed and the recipe's ``reset``
arguments) gives the first observation; the observation's ``observation_key`` field (the whole
observation as JSON when null) is the user message; the policy answers through the endpoint;
the answer goes back as the action (``{action_key: text}``, or the answer parsed as a JSON
object when ``action_key`` is null); the server's observation is the next user message.  This
repeats until the server says ``done``, the run's ``agent.max_turns`` answers were given, or
the next observation does not fit in ``agent.max_total_tokens``.  The sample's reward is the
sum of the step rewards (``null`` counts 0).

**A server that fails costs its samples, not the run.**  A frame that is not the protocol's
(not JSON, an ``error`` frame, an observation without the expected fields, a reward that is
not a number), a server that closes the socket or dies, or no answer within
``message_timeout_s`` raises :class:`EnvironmentServerError`; the agent loop counts the sample
as failed (``agent/failed``), gives it reward 0 and leaves its tokens out of the loss, and the
step goes on.  The socket is dropped after any failure (OpenEnv's replies carry no request id,
so a late answer would otherwise be read as the next one).  We speak the protocol over
``websockets`` ourselves rather than through ``openenv-core``'s client: that client returns an
empty observation for a malformed frame instead of failing, and importing it loads a web UI
stack (gradio) into the process that owns the rollout engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from hf_core.environments.base import ENV_TASK_KEY, Split, register_env_kind, require_library

SEED_KEY = "env_seed"
TRAJECTORY_FULL = "TrajectoryLimit"
"""The endpoint's error type for a request past the trajectory's token budget
(``agent.max_total_tokens``): the episode ends there, scored as far as it went."""


class EnvironmentServerError(RuntimeError):
    """The environment server failed an episode (see the module doc)."""


class OpenEnvSettings(BaseModel):
    """The recipe's ``env`` keys (besides ``kind``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        pattern=r"^(https?|wss?)://", description="the server's base URL (http://host:port)"
    )
    name: str = Field("openenv", min_length=1, description="the task name in metrics")
    size: int = Field(1024, ge=1, description="training episodes (one prompt record each)")
    val_size: int = Field(64, ge=0, description="validation episodes")
    seed: int = Field(0, description="episode i of training resets with seed + i")
    val_seed: int | None = Field(
        None, description="validation episodes' first seed (default seed + size: none shared)"
    )
    reset: dict[str, Any] = Field(
        default_factory=dict, description="more arguments for the server's reset"
    )
    observation_key: str | None = Field(
        None, description="the observation field shown to the policy (null: the JSON of it all)"
    )
    action_key: str | None = Field(
        "message",
        description="the action field the policy's answer fills (null: the answer is the "
        "action's JSON object)",
    )
    system_prompt: str | None = Field(None, description="a system message before the first")
    connect_timeout_s: float = Field(10.0, gt=0, description="opening a session")
    message_timeout_s: float = Field(60.0, gt=0, description="one reset or step answer")

    @property
    def validation_seed(self) -> int:
        return self.seed + self.size if self.val_seed is None else self.val_seed


def _websockets() -> Any:
    """The websockets client module, or a ConfigError saying how to install it."""
    return require_library("websockets.asyncio.client", "openenv", "openenv")


class _Session:
    """One OpenEnv WebSocket session: ``reset`` / ``step`` frames, each answer checked."""

    def __init__(self, socket: Any, settings: OpenEnvSettings) -> None:
        self.socket, self.settings = socket, settings

    async def call(self, kind: str, data: dict[str, Any]) -> tuple[dict[str, Any], float, bool]:
        """Send a ``reset`` or ``step`` frame; the observation, reward (0 for null) and done."""
        url = self.settings.url
        try:
            await self.socket.send(json.dumps({"type": kind, "data": data}))
            raw = await asyncio.wait_for(self.socket.recv(), self.settings.message_timeout_s)
        except TimeoutError:
            raise EnvironmentServerError(
                f"{url}: no answer to {kind} within {self.settings.message_timeout_s} s"
            ) from None
        except Exception as exc:  # the socket closed, the server died
            raise EnvironmentServerError(
                f"{url}: {kind} failed: {type(exc).__name__}: {exc}"
            ) from exc
        return _parse(raw, kind, url)


def _parse(raw: Any, kind: str, url: str) -> tuple[dict[str, Any], float, bool]:
    """An ``observation`` frame's observation, reward and done; EnvironmentServerError for
    anything else (see the module doc)."""
    try:
        frame = json.loads(raw)
    except (TypeError, ValueError):
        raise EnvironmentServerError(f"{url}: {kind} answered non-JSON {str(raw)[:80]!r}") from None
    if not isinstance(frame, dict):
        raise EnvironmentServerError(f"{url}: {kind} answered {str(frame)[:80]!r}, not a frame")
    data = frame.get("data")
    if frame.get("type") == "error":
        message = data.get("message") if isinstance(data, dict) else data
        raise EnvironmentServerError(f"{url}: {kind} refused: {message}")
    if frame.get("type") != "observation" or not isinstance(data, dict):
        raise EnvironmentServerError(f"{url}: {kind} answered a {frame.get('type')!r} frame")
    observation, reward, done = data.get("observation"), data.get("reward"), data.get("done")
    if not isinstance(observation, dict):
        raise EnvironmentServerError(f"{url}: {kind} answered no observation object")
    number = isinstance(reward, (int, float)) and not isinstance(reward, bool)
    if reward is not None and not (number and math.isfinite(reward)):
        raise EnvironmentServerError(f"{url}: {kind} answered reward {reward!r}, not a number")
    if not isinstance(done, bool):
        raise EnvironmentServerError(f"{url}: {kind} answered done={done!r}, not a boolean")
    return observation, float(reward or 0.0), done


class OpenEnvEnvironment:
    """An OpenEnv server's episodes (see the module doc)."""

    Settings: ClassVar[type[BaseModel]] = OpenEnvSettings

    def __init__(self, settings: OpenEnvSettings) -> None:
        self.settings = settings
        self.connect = _websockets().connect
        base = settings.url.rstrip("/")
        base = base.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        self.ws_url = f"{base}/ws"

    def records(self, split: Split) -> list[dict[str, Any]]:
        """One record per episode: its reset seed (the prompt is the first observation, which
        only the server knows; the record's text stands for it in the prompt batch)."""
        size = self.settings.size if split == "train" else self.settings.val_size
        first = self.settings.seed if split == "train" else self.settings.validation_seed
        name = self.settings.name
        return [
            {"prompt": f"{name} episode {first + i}", ENV_TASK_KEY: name, SEED_KEY: first + i}
            for i in range(size)
        ]

    def _message(self, observation: dict[str, Any]) -> str:
        key = self.settings.observation_key
        if key is None:
            return json.dumps(observation, sort_keys=True)
        value = observation.get(key)
        if not isinstance(value, str):
            raise EnvironmentServerError(
                f"{self.settings.url}: the observation has no text field {key!r} "
                f"(env.observation_key); its fields: {sorted(observation)}"
            )
        return value

    def _action(self, answer: str) -> dict[str, Any]:
        key = self.settings.action_key
        if key is not None:
            return {key: answer}
        try:
            action = json.loads(answer)
        except ValueError:
            action = None
        if not isinstance(action, dict):  # the policy's fault: the episode scores 0
            raise ValueError(f"the answer is not a JSON action object: {answer[:80]!r}")
        return action

    async def run(self, client: Any, sample: dict[str, Any], agent: Any) -> Any:
        """One episode against the server (see the module doc)."""
        from hf_core.agents.function_agents import AgentResult

        settings = self.settings
        try:
            socket = await self.connect(
                self.ws_url, open_timeout=settings.connect_timeout_s, max_size=16 * 2**20
            )
        except Exception as exc:
            raise EnvironmentServerError(
                f"{settings.url}: cannot open a session: {type(exc).__name__}: {exc}"
            ) from None
        session = _Session(socket, settings)
        try:
            reset = {"seed": int(sample[SEED_KEY]), **settings.reset}
            observation, total, done = await session.call("reset", reset)
            messages: list[dict[str, Any]] = []
            if settings.system_prompt is not None:
                messages.append({"role": "system", "content": settings.system_prompt})
            turns, truncated = 0, False
            while not done and turns < agent.max_turns:
                messages.append({"role": "user", "content": self._message(observation)})
                try:
                    reply = await client.chat.completions.create(
                        model=agent.model_name, messages=messages
                    )
                except Exception as exc:
                    if getattr(exc, "type", None) != TRAJECTORY_FULL:
                        raise
                    truncated = True  # no room for the observation: the episode ends here
                    break
                answer = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": answer})
                turns += 1
                observation, reward, done = await session.call("step", self._action(answer))
                total += reward
        finally:
            await _close(socket)
        return AgentResult(total, {"turns": turns, "done": done, "truncated": truncated})


async def _close(socket: Any) -> None:
    """End the session: the ``close`` frame, after which the server closes the episode's
    environment and the socket (waited for up to a second, then closed from this side; a dead
    server's socket closes quietly)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(socket.send(json.dumps({"type": "close"})), 1.0)
        async with asyncio.timeout(1.0):
            while True:
                await socket.recv()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(socket.close(), 1.0)


register_env_kind("openenv", OpenEnvEnvironment)
