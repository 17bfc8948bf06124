"""The trainer's side of ``rollout.mode: streaming`` (docs/async.md).

The rollout pool generates continuously on threads of its own
(:mod:`hf_core.roles.rollout_stream`).  This source keeps it fed -- at most ``(1 + k) *
data.batch_size`` prompts submitted and not yet trained or dropped, ``k`` being
``rollout.max_staleness`` -- and gives each step ``data.batch_size`` prompt groups in the
order they finished (:class:`~hf_core.trainer.sample_stream.GroupBuffer`).  After every update
the new weights go out at once: the pool pauses at a token boundary, loads them, and the
responses under way continue on them, so one response may hold tokens of several policy
versions (``token_versions``).  A group whose oldest token is more than ``k`` versions behind
the version being trained is dropped and counted.  Every prompt drawn is in the
:class:`~hf_core.trainer.sample_stream.PromptLedger` (in flight, trained, dropped), which a
checkpoint keeps: a resumed run submits again exactly the prompts that were in flight.

With routing replay (a mixture-of-experts actor, ``algorithm.router_replay: rollout``) every
sample carries the experts of its fed tokens (``routed_experts``, each position's from the
first forward that fed it: :meth:`~hf_core.engines.streaming.StreamRequest.record_routing`),
padded with the other sequence keys when the step's groups are joined
(:func:`~hf_core.trainer.batches.concat_samples`).
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path
from typing import Any

import torch

from hf_core.atomic import replaced_atomically
from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.data import PromptDataset, PromptLoader
from hf_core.engines import SamplingParams
from hf_core.engines.streaming import StreamRequest, responses_batch
from hf_core.roles.rollout_pool import ROLLOUT_VERSION
from hf_core.roles.rollout_stream import FinishedRows
from hf_core.runtime import GroupFuture
from hf_core.trainer.batches import concat_samples, generation_input
from hf_core.trainer.rollout_source import StandaloneRollouts, StepSamples
from hf_core.trainer.sample_stream import (
    TOKEN_VERSIONS,
    FinishedGroup,
    GroupBuffer,
    GroupSamples,
    PromptId,
    PromptLedger,
    oldest_versions,
    version_spread,
)
from hf_core.trainer.spawning import RoleGroups

POLL_S = 0.05
"""How long one collect call waits on the pool for a finished sample."""


class StreamingRollouts(StandaloneRollouts):
    """A standalone pool generating continuously (see the module docstring)."""

    def __init__(self, config: TrainerConfig, groups: RoleGroups, loader: PromptLoader) -> None:
        super().__init__(config, groups, loader)
        rollout = config.rollout
        self.n, self.batch_size = rollout.n, config.data.batch_size
        self.limit = (1 + self.max_staleness) * self.batch_size
        self.buffer = GroupBuffer(self.n)
        self.ledger = PromptLedger()
        self.drawn: dict[PromptId, SamplingParams] = {}
        """Prompts drawn and not yet trained, in draw order, with their sampling parameters."""
        dataset = loader.dataset
        assert isinstance(dataset, PromptDataset), "streaming rollouts draw prompts"
        self.position = {item.sample_index: i for i, item in enumerate(dataset.items)}
        """The dataset position of each ``sample_index`` (prompts are collated from it)."""
        self.pending: deque[PromptId] = deque()
        """Drawn, not yet submitted (waiting for room)."""
        self.submitted: set[PromptId] = set()
        self.samples: dict[PromptId, list[StreamRequest]] = {}
        self.dropped_groups = 0
        self.interrupted_samples = 0
        self.pool_idle_s = 0.0
        self.pool_busy_s = 0.0
        self.recompute: dict[str, float] = {}
        """Since the last step: prefix tokens the pool prefilled again after updates, and
        the seconds that took (engines that keep a KV cache across tokens)."""
        self._next_rank = 0
        self._submitting: list[GroupFuture] = []
        """Submissions sent to the pool and not yet confirmed (the next collect does)."""
        capacity = rollout.stream_capacity or math.ceil(
            self.batch_size * self.n / self.pool.world_size
        )
        opened = self.pool.stream_open(
            capacity, rollout.stream_chunk_tokens, self.max_staleness > 0, rollout.partial_rollouts
        )
        self.pad_token_id: int = opened[0]

    # ---------------------------------------------------------------- feeding
    def _draw(self, step: int) -> None:
        """One loader batch into the pending queue (ids in the ledger as in flight)."""
        epoch = self.loader.epoch
        prompts = next(self.loader)
        params = self._params(step)
        ids: list[PromptId] = [(epoch, int(i)) for i in prompts["sample_index"]]
        for pid in ids:
            self.drawn[pid] = params
        self.ledger.issued(ids)
        self.pending.extend(ids)

    def _top_up(self, step: int) -> None:
        """Submit prompts until ``limit`` are in the pool."""
        room = self.limit - len(self.submitted)
        while len(self.pending) < room and not self.loader.exhausted():
            self._draw(step)
        ids = [self.pending.popleft() for _ in range(min(room, len(self.pending)))]
        self.submitted.update(ids)
        run: list[PromptId] = []
        for pid in ids:  # one submission per run of prompts sharing epoch and parameters
            if run and self._kind(pid) != self._kind(run[0]):
                self._submit(run)
                run = []
            run.append(pid)
        if run:
            self._submit(run)

    def _kind(self, pid: PromptId) -> tuple[int, SamplingParams]:
        return pid[0], self.drawn[pid]

    def _submit(self, ids: list[PromptId]) -> None:
        """Queue prompts on the pool.  With ``k = 0`` each rank gets a contiguous share, as
        the batch path splits a batch (each share is one generate call there); otherwise
        round robin, which keeps the ranks' queues even."""
        ranks = self.pool.world_size
        if self.max_staleness == 0:
            share = math.ceil(len(ids) / ranks)
            per_rank = [ids[r * share : (r + 1) * share] for r in range(ranks)]
        else:
            per_rank = [[] for _ in range(ranks)]
            for pid in ids:
                per_rank[self._next_rank].append(pid)
                self._next_rank = (self._next_rank + 1) % ranks
        work = [self._work(chunk) if chunk else None for chunk in per_rank]
        # not waited for here: the pool takes calls in order, so the next collect sees it
        self._submitting.append(self.pool.stream_submit.remote(work))

    def _work(self, ids: list[PromptId]) -> tuple[Batch, SamplingParams, int]:
        """One rank's submission: the prompts, their sampling parameters and epoch."""
        collated = self._prompts(ids)
        prompts = generation_input(collated, self.config)
        if "sample_index" not in prompts:
            prompts = prompts | collated.select("sample_index")
        return prompts, self.drawn[ids[0]], ids[0][0]

    def _prompts(self, ids: list[PromptId]) -> Batch:
        """The prompts of ``ids`` as the loader would batch them (left-padded together)."""
        return self.loader.dataset.collate([self.position[pid[1]] for pid in ids])

    def _collect(self, wait_s: float) -> None:
        """Finished samples from every rank into the buffer."""
        submitted, self._submitting = self._submitting, []
        for future in submitted:  # a submission the pool refused fails here
            future.result()
        for done, metrics in self.pool.stream_collect(wait_s):
            self.pool_idle_s += metrics["stream/pool_idle_s"]
            self.pool_busy_s += metrics["stream/pool_busy_s"]
            for key in ("stream/recomputed_tokens", "stream/recompute_s"):
                if key in metrics:
                    self.recompute[key] = self.recompute.get(key, 0.0) + metrics[key]
            self._metrics["stream/queued_samples"] = metrics["stream/queued_samples"]
            for item in done:
                if isinstance(item, FinishedRows):
                    self._add_rows(item)
                    continue
                pid: PromptId = (item.key[0], item.key[1])
                self.samples.setdefault(pid, []).append(item)
                if len(self.samples[pid]) == self.n:
                    requests = sorted(self.samples.pop(pid), key=lambda r: r.key[2])
                    self.buffer.add_requests(pid, requests)

    def _add_rows(self, finished: FinishedRows) -> None:
        """A whole call's rows, one group per prompt, in the call's order."""
        by_prompt: dict[PromptId, list[int]] = {}
        for row, key in enumerate(finished.keys):
            by_prompt.setdefault((key[0], key[1]), []).append(row)
        for pid, rows in by_prompt.items():
            self.buffer.add(pid, finished.rows.index(rows))

    # ---------------------------------------------------------------- schedule
    def take(self, step: int) -> StepSamples:
        self.actor_version = step - 1
        return self._take_groups(step, self.batch_size)

    def take_more(self, step: int, round_: int, groups: int) -> StepSamples:
        """``groups`` more finished groups from the stream (dynamic sampling)."""
        return self._take_groups(step, groups)

    def discard(self, samples: StepSamples, groups: list[int], reason: str) -> None:
        """Groups taken for a step and then left out: dropped in the ledger, not trained."""
        if samples.prompt_ids is None:
            raise RuntimeError("streaming samples carry their prompt ids")
        self.ledger.withdrawn([samples.prompt_ids[g] for g in groups], reason)

    def _take_groups(self, step: int, count: int) -> StepSamples:
        """The next ``count`` finished groups within the staleness bound (waiting for them)."""
        if self.max_staleness > 0:
            # the pool ran ahead: take what it finished while its generation thread is idle,
            # before new submissions wake it to compete with the pool's reply for its core
            self._collect(0.0)
        groups: list[FinishedGroup] = []
        while len(groups) < count:
            self._top_up(step)
            kept, dropped = self.buffer.take(count - len(groups), step - 1, self.max_staleness)
            groups += kept
            for group in dropped:
                self.ledger.dropped([group.prompt_id], f"stale at step {step}")
                self.submitted.discard(group.prompt_id)
                self.dropped_groups += 1
                self.dropped_samples += len(group.samples)
            if len(groups) < count:
                if not self.submitted and not self.pending and self.loader.exhausted():
                    raise RuntimeError(
                        f"step {step}: the prompt loader ran out with {len(groups)} of "
                        f"{count} groups (the rest were dropped as stale)"
                    )
                self._collect(POLL_S)
        if self.max_staleness == 0:  # the synchronous loop's order: the order drawn
            drawn = {pid: i for i, pid in enumerate(self.drawn)}
            groups.sort(key=lambda g: drawn[g.prompt_id])
        ids = [group.prompt_id for group in groups]
        for pid in ids:
            self.submitted.discard(pid)
        self.ledger.trained(ids, step)
        prompts = self._prompts(ids)
        for pid in ids:
            del self.drawn[pid]
        generated = self._step_batch([group.samples for group in groups])
        version = int(generated[ROLLOUT_VERSION].min())
        self._step_metrics(step, generated)
        return StepSamples(step, prompts, generated, version, prompt_ids=ids)

    def _step_batch(self, groups: list[GroupSamples]) -> Batch:
        """The step's groups as one batch of rollout-engine output (prompts left-padded,
        responses right-padded to common widths).  Groups of stream requests become rows
        here, in one :func:`responses_batch` for the whole step: the driver's work per step
        stays a few tensor builds however many groups it takes."""
        request_groups = [group for group in groups if isinstance(group, list)]
        if len(request_groups) == len(groups):
            requests = [request for group in request_groups for request in group]
            out = responses_batch(requests, self.pad_token_id)
        else:
            rows = [
                group if isinstance(group, Batch) else responses_batch(group, self.pad_token_id)
                for group in groups
            ]
            out = concat_samples(rows)
            out.meta["temperature"] = rows[0].meta.get("temperature", 1.0)
        mask = out["response_mask"]
        out[ROLLOUT_VERSION] = oldest_versions(out[TOKEN_VERSIONS], mask)
        out["policy_version"] = out[ROLLOUT_VERSION].clone()
        return out

    def _step_metrics(self, step: int, generated: Batch) -> None:
        trained_at = step - 1
        mask = _tensor(generated["response_mask"])
        oldest = _tensor(generated[ROLLOUT_VERSION])
        staleness = trained_at - oldest
        for age in staleness.tolist():
            self.staleness_counts[age] = self.staleness_counts.get(age, 0) + 1
        spread = version_spread(_tensor(generated[TOKEN_VERSIONS]), mask).float()
        interrupted = int(_tensor(generated["interrupted"]).sum())
        self.interrupted_samples += interrupted
        busy_idle = self.pool_idle_s + self.pool_busy_s
        self._metrics.update(
            {
                **{
                    f"async/samples_at_staleness_{age}": float(self.staleness_counts.get(age, 0))
                    for age in range(self.max_staleness + 1)
                },
                "async/staleness": float(staleness.float().mean()),
                "async/staleness_max": float(staleness.max()),
                "async/policy_version": float(oldest.min()),
                "async/rollout_version": float(oldest.min()),
                "async/in_flight": float(len(self.submitted) + len(self.pending)),
                "async/dropped_samples": float(self.dropped_samples),
                "stream/version_spread_mean": float(spread.mean()),
                "stream/version_spread_max": float(spread.max()),
                "stream/interrupted_samples": float(interrupted),
                "stream/interrupted_samples_total": float(self.interrupted_samples),
                "stream/buffer_depth": float(self.buffer.depth),
                "stream/dropped_groups": float(self.dropped_groups),
                "stream/pool_idle_frac": self.pool_idle_s / busy_idle if busy_idle else 0.0,
                **self.ledger.counts(),
                **self.recompute,
            }
        )
        self.recompute = {}
        self.pool_idle_s = self.pool_busy_s = 0.0

    # ------------------------------------------------------------------- sync
    def after_update(self, step: int) -> dict[str, float]:
        """The new weights go out at once: the pool pauses at a token boundary, loads them,
        and continues the responses under way on them."""
        self.actor_version = step
        metrics = self._finish_syncs()
        metrics.update(self.sync(step))
        return metrics

    # ------------------------------------------------------------ checkpoints
    def loader_state(self) -> dict[str, Any]:
        """The loader's position after every prompt drawn: the ledger names those in flight."""
        return self.loader.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the prompts in flight at the checkpoint are drawn again, first."""
        if "ledger" not in state:
            return
        self.ledger.load_state_dict(state["ledger"])
        step = self.rollout_version + 1  # the restored weights were just sent
        for epoch, index in self.ledger.in_flight():
            if index not in self.position:
                raise ValueError(
                    f"the checkpoint's ledger has prompt {index} in flight, which the dataset "
                    "does not hold (was the data changed?)"
                )
            self.drawn[(epoch, index)] = self._params(step)
            self.pending.append((epoch, index))

    def write_account(self, folder: Path, attempt: int, failure: BaseException | None) -> None:
        """``prompt_ledger.jsonl`` (one JSON row per prompt drawn); an attempt that failed
        writes ``prompt_ledger.attempt<N>.jsonl`` with its prompts in flight marked lost (a
        restart resumes from the last checkpoint's ledger, which holds them in flight)."""
        ledger = self.ledger
        name = "prompt_ledger.jsonl"
        if failure is not None:
            ledger = PromptLedger()
            ledger.load_state_dict(self.ledger.state_dict())
            ledger.lost(ledger.in_flight(), f"{type(failure).__name__} in attempt {attempt}")
            name = f"prompt_ledger.attempt{attempt}.jsonl"
        rows = "".join(json.dumps(row) + "\n" for row in ledger.rows())
        with replaced_atomically(folder / name) as tmp:
            tmp.write_text(rows)


def _tensor(value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(value).__name__}")
    return value
