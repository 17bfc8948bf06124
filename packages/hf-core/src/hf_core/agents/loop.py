"""The agent loop: multi-turn, tool-using rollouts over any :class:`RolloutEngine`.

Token in, token out.  Each sample is a growing list of token ids: its prompt, then turn by
turn the ids the engine sampled (kept exactly as returned, never decoded and re-encoded) and
the ids of each tool message.  Samples go to the engine together as one batch of left-padded
contexts (``n=1``), so the engine batches them as it batches prompts: by default in rounds
(all unfinished samples generate, then all tool calls run); with ``agent.continuous`` the
tools run in the background and each engine call takes every sample that is ready, whatever
its turn, so a slow tool holds back only its own sample.  After a turn the sample's new text
is parsed for
``<tool_call>`` blocks (:mod:`hf_core.tool_calls`); the calls of every sample run
concurrently, and their answers are appended as a tool message
(``agent.tool_response_template``) with loss mask 0.  A turn without calls ends the sample,
unless a per-sample environment answers it (``step`` returns an observation).  Limits: turns
per sample and response tokens per sample (model and tool tokens together).

The result has the single-turn engine's batch keys (:class:`RolloutEngine`), so the trainer
consumes it unchanged: ``responses`` holds the whole trajectory after the prompt,
``attention_mask`` covers every real token (tool messages are context the model attends to),
``response_mask`` is 1 only on tokens the model sampled (what the policy loss and KL weigh),
and ``rollout_log_probs`` holds the engine's log-prob of each of those (0 elsewhere), so the
training engine's log-probs line up token by token.  With routing replay
(``SamplingParams.routed_experts``) on a mixture-of-experts model it adds ``routed_experts``:
each fed position's experts, from the first turn that fed it (a tool message's tokens are fed,
and routed, by the next turn).  Per sample it adds ``trajectory`` (the
decoded text after the prompt, tool messages included) and ``tool_calls`` (name, arguments,
result, status of each call) for reward functions, and counters for :func:`agent_metrics`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hf_core.agents.config import AgentConfig
from hf_core.agents.environment import Environment, load_environment
from hf_core.agents.tools import Tool, ToolResult
from hf_core.batch import Batch
from hf_core.engines.decoding import strip_left_padding
from hf_core.engines.rollout import RolloutEngine, SamplingParams, assemble_rollout
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, keep_first_routing, routing_batch
from hf_core.errors import ConfigError
from hf_core.tool_calls import MalformedCall, parse_tool_calls

COUNTERS = ("agent_turns", "agent_tool_calls", "agent_tool_errors", "agent_tool_timeouts")
"""Per-sample counters the loop adds (int tensors [B])."""


GATHER_WINDOW_S = 0.02
"""Continuous mode: once a tool answers, how long to wait for others that are about to, so
they share the next engine call instead of each making its own."""


@dataclass
class _Sample:
    """One trajectory under construction."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    environment: Environment | None = None
    routed: torch.Tensor | None = None
    """Routing replay: ``[positions, moe layers, k]`` experts of the positions fed so far
    (prompt, then trajectory; :func:`~hf_core.engines.routed_experts.keep_first_routing`)."""

    def add(self, tokens: list[int], log_probs: list[float] | None) -> None:
        self.tokens += tokens
        self.model_mask += [1 if log_probs is not None else 0] * len(tokens)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(tokens)


class AgentLoop:
    """Runs multi-turn rollouts for prompt batches on ``engine`` (see the module docstring)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        config: AgentConfig,
        tools: dict[str, Tool],
    ) -> None:
        """``tools``: the tools the model may call, by name (``config.tools`` resolved by
        :func:`hf_core.plugins.tools.resolve_tools`)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.tools = tools
        self.environment_cls = load_environment(config.environment) if config.environment else None
        if tokenizer.pad_token_id is None:
            raise ConfigError("agent: the tokenizer has no pad token")
        self.pad_token_id = int(tokenizer.pad_token_id)

    # --------------------------------------------------------------- the loop
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Like :meth:`RolloutEngine.generate`, with turns: ``params.n`` trajectories per
        prompt (consecutive rows); ``params.max_new_tokens`` bounds each turn."""
        prompts = prompts.repeat_interleave(params.n) if params.n > 1 else prompts
        rows = strip_left_padding(prompts["input_ids"], prompts["attention_mask"])
        samples = [_Sample(row) for row in rows]
        if self.environment_cls is not None:
            for sample in samples:
                sample.environment = self.environment_cls()
                sample.environment.reset(self._decode(sample.prompt))
        if self.config.continuous:
            self._run_continuous(samples, params)
        else:
            self._run_rounds(samples, params)
        return self._assemble(prompts, samples, params.temperature)

    def _turn(
        self, batch: list[_Sample], params: SamplingParams, call_index: int
    ) -> list[tuple[_Sample, str]]:
        """One engine call for ``batch`` (each sample at whatever turn it is): the sampled
        ids and log-probs are appended as they came; returns each sample's new text."""
        budget = self.config.max_total_tokens
        room = max(budget - len(s.tokens) for s in batch)
        turn_params = params.model_copy(
            update={
                "n": 1,
                "max_new_tokens": min(params.max_new_tokens, room),
                "seed": None if params.seed is None else params.seed + 7919 * call_index,
            }
        )
        contexts = self._contexts(batch)
        out = self.engine.generate(contexts, turn_params)
        responses, mask = out["responses"], out["response_mask"].bool()
        log_probs = out["rollout_log_probs"]
        # routing replay: each turn's forward feeds the context again, the first one's kept
        routed = out[ROUTED_EXPERTS_KEY] if ROUTED_EXPERTS_KEY in out else None
        width = contexts["input_ids"].shape[1]
        texts = []
        for i, sample in enumerate(batch):
            keep = min(int(mask[i].sum()), budget - len(sample.tokens))
            new = responses[i][mask[i]][:keep].tolist()
            if routed is not None:
                context = len(sample.prompt) + len(sample.tokens)
                fed = routed[i, width - context : width + keep]
                sample.routed = keep_first_routing(sample.routed, fed, f"agent sample {i}")
            sample.add(new, log_probs[i][mask[i]][:keep].tolist())
            sample.turns += 1
            texts.append((sample, self._decode(new)))
        return texts

    def _run_rounds(self, samples: list[_Sample], params: SamplingParams) -> None:
        """Rounds: every unfinished sample generates, then every tool call runs."""
        call_index = 0
        while active := [s for s in samples if not s.done]:
            asyncio.run(self._answer(self._turn(active, params, call_index)))
            call_index += 1

    def _run_continuous(self, samples: list[_Sample], params: SamplingParams) -> None:
        """Tools run in the background: each engine call takes every sample that is ready
        (its tools answered), whatever its turn, while slower tools keep running."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="agent-tools", daemon=True)
        thread.start()
        running: dict[concurrent.futures.Future[str | None], _Sample] = {}
        try:
            ready, call_index = list(samples), 0
            while ready or running:
                if not ready:
                    first = concurrent.futures.FIRST_COMPLETED
                    concurrent.futures.wait(running, return_when=first)
                    concurrent.futures.wait(running, timeout=GATHER_WINDOW_S)
                for future in [f for f in running if f.done()]:
                    sample = running.pop(future)
                    self._apply(sample, future.result())
                    if not sample.done:
                        ready.append(sample)
                if ready:
                    batch, ready = ready, []
                    for sample, text in self._turn(batch, params, call_index):
                        future = asyncio.run_coroutine_threadsafe(self._respond(sample, text), loop)
                        running[future] = sample
                    call_index += 1
        finally:
            for future in running:
                future.cancel()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    async def _answer(self, pending: list[tuple[_Sample, str]]) -> None:
        """After a round: run each sample's tool calls (all samples concurrently) or ask its
        environment, then apply the answers."""
        results = await asyncio.gather(*[self._respond(s, text) for s, text in pending])
        for (sample, _), answer in zip(pending, results, strict=True):
            self._apply(sample, answer)

    def _apply(self, sample: _Sample, answer: str | None) -> None:
        """Append the tool message (loss mask 0), or mark the sample done (None)."""
        if answer is None:
            sample.done = True
            return
        ids = self.tokenizer(
            self.config.tool_response_template.format(result=answer),
            add_special_tokens=False,
        )["input_ids"]
        room = self.config.max_total_tokens - len(sample.tokens)
        sample.add(list(ids)[:room], None)
        if len(ids) >= room or sample.turns >= self.config.max_turns:
            sample.done = True

    async def _respond(self, sample: _Sample, text: str) -> str | None:
        """The tool message for this turn, or None when the sample is finished."""
        if len(sample.tokens) >= self.config.max_total_tokens or (
            sample.turns >= self.config.max_turns
        ):
            return None
        calls = parse_tool_calls(text)
        if not calls:
            env = sample.environment
            return None if env is None else await asyncio.to_thread(env.step, text)
        limit = self.config.max_tool_calls_per_turn
        answers = await asyncio.gather(*[self._call(sample, c) for c in calls[:limit]])
        if len(calls) > limit:
            answers.append(f"error: at most {limit} tool calls per turn; the rest were skipped")
        return "\n".join(answers)

    async def _call(self, sample: _Sample, call: Any) -> str:
        if isinstance(call, MalformedCall):
            result = ToolResult(call.error, "error")
            name, arguments = None, call.text
        else:
            name, arguments = call.name, call.arguments
            tool = self.tools.get(call.name)
            if tool is None:
                known = ", ".join(sorted(self.tools)) or "(none)"
                result = ToolResult(f"error: no tool {call.name!r}; tools: {known}", "error")
            else:
                result = await tool.call(call.arguments, timeout_s=self.config.tool_timeout_s)
        sample.calls.append(
            {"name": name, "arguments": arguments, "result": result.text, "status": result.status}
        )
        return result.text

    # ------------------------------------------------------------- batches
    def _contexts(self, samples: list[_Sample]) -> Batch:
        """Prompt + trajectory so far of each sample, left-padded: the next turn's input."""
        contexts = [s.prompt + s.tokens for s in samples]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context) :] = torch.tensor(context)
            mask[row, width - len(context) :] = 1
        return Batch({"input_ids": ids, "attention_mask": mask})

    def _assemble(self, prompts: Batch, samples: list[_Sample], temperature: float) -> Batch:
        width = self.config.max_total_tokens
        size = len(samples)
        responses = torch.full((size, width), self.pad_token_id, dtype=torch.long)
        real = torch.zeros((size, width), dtype=torch.long)
        model = torch.zeros((size, width), dtype=torch.long)
        log_probs = torch.zeros((size, width), dtype=torch.float32)
        for row, s in enumerate(samples):
            n = len(s.tokens)
            responses[row, :n] = torch.tensor(s.tokens, dtype=torch.long)
            real[row, :n] = 1
            model[row, :n] = torch.tensor(s.model_mask, dtype=torch.long)
            log_probs[row, :n] = torch.tensor(s.log_probs, dtype=torch.float32)
        out = assemble_rollout(prompts, responses, real, log_probs, temperature)
        out["response_mask"] = model  # attention covers tool tokens; the loss does not
        recorded = [(s.routed, len(s.prompt), len(s.tokens)) for s in samples]
        routed = routing_batch(recorded, prompts["input_ids"].shape[1], width)
        if routed is not None:
            out[ROUTED_EXPERTS_KEY] = routed
        out["trajectory"] = np.array([self._decode(s.tokens) for s in samples], dtype=object)
        tool_calls = np.empty(size, dtype=object)
        tool_calls[:] = [list(s.calls) for s in samples]
        out["tool_calls"] = tool_calls
        out["agent_turns"] = torch.tensor([s.turns for s in samples])
        out["agent_tool_calls"] = torch.tensor([len(s.calls) for s in samples])
        for status in ("error", "timeout"):
            out[f"agent_tool_{status}s"] = torch.tensor(
                [sum(c["status"] == status for c in s.calls) for s in samples]
            )
        return out

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))


def agent_metrics(batch: Batch) -> dict[str, float]:
    """``agent/*`` means per sample for a step's log (empty for single-turn batches)."""
    if "agent_turns" not in batch:
        return {}
    tool_tokens = (
        batch["attention_mask"][:, -batch["responses"].shape[1] :].sum()
        - batch["response_mask"].sum()
    )
    size = len(batch)
    failures = {  # agent.function runs per step that raised or ran out of time (masked out)
        f"agent/{key}": float(torch.as_tensor(batch[f"agent_{key}"]).sum())
        for key in ("failed", "timed_out")
        if f"agent_{key}" in batch
    }
    return {
        **failures,
        "agent/turns_mean": float(batch["agent_turns"].float().mean()),
        "agent/tool_calls_mean": float(batch["agent_tool_calls"].float().mean()),
        "agent/tool_errors_mean": float(batch["agent_tool_errors"].float().mean()),
        "agent/tool_timeouts_mean": float(batch["agent_tool_timeouts"].float().mean()),
        "agent/tool_tokens_mean": float(tool_tokens) / max(size, 1),
    }
