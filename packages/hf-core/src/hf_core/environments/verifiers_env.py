"""A ``verifiers`` environment as a run's environment (``env: {kind: verifiers, environment:
<id>}``): its tasks are the prompts, each sample is one of its episodes run by the library
against the policy's OpenAI-compatible endpoint, and its own rubric's score is the reward.

Install with ``pip install 'hf-core[verifiers]'`` (verifiers 0.4, whose stack lives in
``verifiers.v1``).  ``environment`` is a verifiers environment id: an installed module that
exports its ``Taskset`` (and, for an environment with its own episode logic such as a game
that answers the policy, its ``Env``) in ``__all__``, which is how the library finds
environments, the hub's included.

**An episode.**  The library's ``Env.run_episode(task, ctx)`` runs it: its agent harness talks
to a per-episode interception server of the library, which forwards every model request to
the sample's trajectory on our endpoint (``ctx``: the trajectory's base URL, its key through
an environment variable of its own, as the library reads keys only from the environment; no
sampling settings, so the run's apply).  Each turn re-sends the conversation so far, which
the endpoint accepts only as the exact continuation of its token sequence, so the trained
tokens are exactly the sampled ones and the environment's messages are context.  The harness
is :mod:`hf_core.environments.verifiers_harness` (one non-streaming chat completion a turn,
in-process): the library's own chat harnesses run a program through ``uv`` (which needs the
network) and stream, which the endpoint does not offer.  The trained seat's trace gives the
reward (the rubric's weighted sum); a trace the library marks failed (``ok`` false: a
refused request, a harness error) or an error of the environment fails the sample
(``agent/failed``, reward 0, out of the loss).

**Tasks.**  The taskset's tasks in its order: the last ``val_size`` validate, the ones before
them (at most ``size``) train.  A record's prompt is the task's prompt as chat messages (its
system prompt first) so the prompt batch resembles what the first request renders; its
``env_index`` picks the task again where the episode runs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from hf_core.environments.base import ENV_TASK_KEY, Split, register_env_kind, require_library
from hf_core.errors import ConfigError

INDEX_KEY = "env_index"
HARNESS = "hf_core.environments.verifiers_harness"


class VerifiersEpisodeError(RuntimeError):
    """The library reported an episode as failed (see the module doc)."""


class VerifiersSettings(BaseModel):
    """The recipe's ``env`` keys (besides ``kind``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    environment: str = Field(min_length=1, description="a verifiers environment id (a module)")
    name: str | None = Field(None, description="the task name in metrics (default: the id)")
    taskset: dict[str, Any] = Field(
        default_factory=dict, description="the taskset's own settings (its TasksetConfig)"
    )
    settings: dict[str, Any] = Field(
        default_factory=dict, description="the environment's own settings (its EnvConfig)"
    )
    seat: str | None = Field(
        None, description="the seat the policy trains (default: the environment's only one)"
    )
    size: int | None = Field(None, ge=1, description="training tasks (default: all left)")
    val_size: int = Field(0, ge=0, description="validation tasks: the taskset's last ones")
    harness: str = Field(HARNESS, description="the verifiers harness id each seat runs")
    runtime: dict[str, Any] = Field(
        default_factory=lambda: {"type": "subprocess"},
        description="the verifiers runtime each seat runs in",
    )

    @property
    def task_name(self) -> str:
        return self.name or self.environment


def _library() -> Any:
    """``verifiers.v1``, or a ConfigError saying how to install it."""
    return require_library("verifiers.v1", "verifiers", "verifiers")


class VerifiersEnvironment:
    """A verifiers environment's tasks and episodes (see the module doc)."""

    Settings: ClassVar[type[BaseModel]] = VerifiersSettings

    def __init__(self, settings: VerifiersSettings) -> None:
        self.settings = settings
        self.vf = _library()
        self._episodes: dict[tuple[int, float], Any] = {}
        """The library's Env per (max_turns, timeout): built where episodes run."""
        probe = self._load({"id": HARNESS}, max_turns=1, timeout_s=60.0)
        seats = self._seats(probe.config)
        if settings.seat is None and len(seats) != 1:
            raise ConfigError(
                f"env.seat: {settings.environment} has seats {seats}; name the one that trains"
            )
        if settings.seat is not None and settings.seat not in seats:
            raise ConfigError(f"env.seat: {settings.seat!r} is not one of {seats}")
        self.seat = settings.seat or seats[0]
        try:
            self.tasks = list(probe.taskset)
        except Exception as exc:
            raise ConfigError(
                f"env.taskset: {settings.environment} could not load its tasks: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        if len(self.tasks) <= settings.val_size:
            raise ConfigError(
                f"env.val_size: {settings.environment} has {len(self.tasks)} tasks, "
                f"not more than val_size={settings.val_size}"
            )

    # ------------------------------------------------------------ the library
    def _seats(self, config: Any) -> list[str]:
        """The environment config's seats: its fields holding an agent config."""
        fields = type(config).model_fields
        return [name for name in fields if isinstance(getattr(config, name), self.vf.AgentConfig)]

    def _load(self, harness: dict[str, Any], *, max_turns: int, timeout_s: float) -> Any:
        """The library's Env with every seat on ``harness`` (validation errors named)."""
        s = self.settings
        seat = {
            "harness": harness,
            "runtime": dict(s.runtime),
            "max_turns": max_turns,
            "timeout": {"rollout": timeout_s},
        }
        environment = _plugin_id(s.environment, "env.environment")
        harness = {**harness, "id": _plugin_id(harness["id"], "env.harness")}
        seat["harness"] = harness
        raw: dict[str, Any] = {"taskset": {"id": environment, **s.taskset}, **s.settings}
        try:
            config = self.vf.resolve_env_config(raw)
            for name in self._seats(config):
                raw[name] = seat
            return self.vf.load_environment(self.vf.resolve_env_config(raw))
        except ModuleNotFoundError as exc:
            raise ConfigError(f"env.environment: {exc}") from None
        except Exception as exc:  # the library's validation of the settings
            raise ConfigError(
                f"env: verifiers refused {s.environment}'s settings: {type(exc).__name__}: {exc}"
            ) from None

    def _episodes_env(self, agent: Any) -> Any:
        key = (int(agent.max_turns), float(agent.timeout_s))
        if key not in self._episodes:
            self._episodes[key] = self._load(
                {"id": self.settings.harness}, max_turns=key[0], timeout_s=key[1]
            )
        return self._episodes[key]

    # ------------------------------------------------------------------ data
    def records(self, split: Split) -> list[dict[str, Any]]:
        """The split's tasks as prompt records (see the module doc)."""
        count, val = len(self.tasks), self.settings.val_size
        if split == "val":
            indices = range(count - val, count)
        else:
            train = count - val
            indices = range(min(train, self.settings.size or train))
        return [self._record(i) for i in indices]

    def _record(self, index: int) -> dict[str, Any]:
        data = self.tasks[index].data
        messages: list[dict[str, Any]] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": str(data.system_prompt)})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            from verifiers.v1.dialects.chat import message_to_wire

            messages += [dict(message_to_wire(m)) for m in data.prompt]
        prompt: Any = messages or f"{self.settings.task_name} task {index}"
        return {"prompt": prompt, ENV_TASK_KEY: self.settings.task_name, INDEX_KEY: index}

    # --------------------------------------------------------------- episode
    async def run(self, client: Any, sample: dict[str, Any], agent: Any) -> Any:
        """One episode of the sample's task against its trajectory (see the module doc)."""
        from hf_core.agents.function_agents import AgentResult

        env = self._episodes_env(agent)
        task = self.tasks[int(sample[INDEX_KEY])]
        with _key_variable(str(client.api_key)) as variable:
            context = self.vf.ModelContext(
                model=agent.model_name,
                client=self.vf.EvalClientConfig(
                    base_url=str(client.base_url).rstrip("/"),
                    api_key_var=variable,
                    timeout={"connect": 30.0, "read": float(agent.timeout_s)},
                ),
                sampling=self.vf.SamplingConfig(),
            )
            episode = await env.run_episode(task, context)
        traces = [t for t in episode.traces if t.agent.name == self.seat] or list(episode.traces)
        if not traces:
            raise VerifiersEpisodeError(f"{self.settings.environment}: the episode ran no agent")
        trace = traces[0]
        problems = [*getattr(episode, "errors", []), *trace.errors]
        if not trace.ok or problems:
            first = problems[0] if problems else None
            detail = f"{first.type}: {first.message}" if first is not None else "not ok"
            raise VerifiersEpisodeError(
                f"{self.settings.environment}: episode failed ({trace.stop_condition}): {detail}"
            )
        info = {"turns": trace.num_turns, "stop": trace.stop_condition, **dict(trace.metrics)}
        return AgentResult(float(trace.reward), info)


def _plugin_id(name: str, key: str) -> str:
    """The id verifiers can import ``name`` by: a dotted module path (``my_pkg.envs.guess``)
    is imported here and registered under an undotted alias, because the library looks an id
    up as a submodule of its own packages first and a dotted one breaks that lookup; plain
    ids (and hub ids, ``owner/name``) pass unchanged."""
    if "." not in name or "/" in name:
        return name
    alias = "hf_vf_" + name.replace(".", "_")
    if alias not in sys.modules:
        try:
            sys.modules[alias] = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"{key}: cannot import {name!r}: {exc}") from None
    return alias


@contextlib.contextmanager
def _key_variable(key: str) -> Iterator[str]:
    """The trajectory's key in an environment variable of its own for the episode (the
    library reads keys only from the environment; its subprocess runtimes drop variables
    named ``*API_KEY*`` from their children)."""
    name = f"HF_TRAJECTORY_API_KEY_{secrets.token_hex(8).upper()}"
    os.environ[name] = key
    try:
        yield name
    finally:
        os.environ.pop(name, None)


register_env_kind("verifiers", VerifiersEnvironment)
