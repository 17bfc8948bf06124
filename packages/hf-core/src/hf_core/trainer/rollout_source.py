"""Where each step's samples come from, and when the rollout engine gets new weights.

:class:`HybridRollouts`: the actor's own rollout engine (the hybrid engine): draw prompts,
generate, and sync the weights after every update -- the synchronous loop.

:class:`StandaloneRollouts`: a rollout pool of its own (``placement.mode: standalone``).
With ``rollout.max_staleness: k`` > 0 it keeps up to ``k`` future batches in flight, so the
rollout pool generates step ``s + 1`` while the actor trains on step ``s``.  Every batch
carries the policy version (actor updates completed) of the weights that produced it; a batch
for step ``j`` is only launched with weights at least version ``j - 1 - k``, so it is at most
``k`` versions old when step ``j`` trains on it.  New weights reach the pool between generate
calls: a sync that would wait for other in-flight generations is put off instead, so the
actor never idles behind the rollout pool for more than the batch it needs next.  With
``k = 0`` nothing runs ahead and the weights go out right after each update: exactly the
synchronous loop, only across pools.  The pool reports the version it really generated each
batch with (``rollout_version`` per sample, from the actor's update count sent with the
weights); ``async/rollout_version`` logs it next to the schedule's ``async/policy_version``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.data import PromptLoader
from hf_core.engines import SamplingParams
from hf_core.roles.rollout_pool import ROLLOUT_VERSION
from hf_core.runtime import GroupFuture, WorkerError, WorkerLostError
from hf_core.sync import merge_rank_metrics
from hf_core.trainer.batches import generation_input, sampling_params
from hf_core.trainer.spawning import RoleGroups

EXTRA_ROUND_SEED_STRIDE = 1 << 40
"""Seed offset of each extra draw of a step: far from every step's own seed."""


@dataclass
class StepSamples:
    """One step's prompts and the rollout engine's samples for them."""

    step: int
    prompts: Batch
    generated: Batch
    version: int
    """Actor updates the generating weights had seen (the policy version)."""
    prompt_ids: list[tuple[int, int]] | None = None
    """Per prompt (epoch, sample_index), where the source keeps a ledger (streaming)."""


@dataclass
class _InFlight:
    step: int
    prompts: Batch
    future: GroupFuture
    version: int
    loader_state: dict[str, Any]
    """The prompt loader's state before these prompts were drawn (what a checkpoint keeps,
    so a resumed run draws them again and regenerates them)."""


class RolloutSource(ABC):
    """Draws each step's prompts and produces its samples; keeps the rollout weights fresh."""

    def __init__(self, config: TrainerConfig, groups: RoleGroups, loader: PromptLoader) -> None:
        self.config, self.groups, self.loader = config, groups, loader
        self._metrics: dict[str, float] = {}

    def _params(self, step: int) -> SamplingParams:
        replay = self.config.algorithm.router_replay == "rollout"
        return sampling_params(
            self.config.rollout, step, self.config.run.seed, routed_experts=replay
        )

    @abstractmethod
    def take(self, step: int) -> StepSamples:
        """The samples step ``step`` trains on (the actor has completed ``step - 1`` updates)."""

    def take_more(self, step: int, round_: int, groups: int) -> StepSamples:
        """Extra samples for step ``step`` (dynamic sampling's round ``round_`` >= 1), at
        least ``groups`` prompt groups where the source can size them: the loader's next
        batch, generated now with the weights the engine holds, seeded apart per round."""
        prompts = next(self.loader)
        params = self._params(step)
        params = params.model_copy(
            update={"seed": (params.seed or 0) + round_ * EXTRA_ROUND_SEED_STRIDE}
        )
        generated = self.generate_now(generation_input(prompts, self.config), params)
        return StepSamples(step, prompts, generated, version=step - 1)

    def discard(self, samples: StepSamples, groups: list[int], reason: str) -> None:
        """The trainer leaves out groups ``groups`` of ``samples`` (dynamic sampling).
        Default: nothing to record (the loader's position says which prompts were used)."""

    @abstractmethod
    def after_update(self, step: int) -> dict[str, float]:
        """The actor finished update ``step``; the metrics of any weight sync it started."""

    def queue_after_update(self, step: int) -> Callable[[], dict[str, float]]:
        """Called right after update ``step`` was sent to the actor, before waiting for it:
        queue what can run behind the update on the actor (its calls run in order), and
        return the wait for it, which gives :meth:`after_update`'s metrics.  By default
        nothing is queued: the returned call runs :meth:`after_update` then."""
        return lambda: self.after_update(step)

    @abstractmethod
    def sync(self, version: int) -> dict[str, float]:
        """Send the actor's weights (policy version ``version``) to the rollout engine now."""

    @abstractmethod
    def generate_now(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Generate outside the step schedule (validation, ReMax's greedy baseline)."""

    def loader_state(self) -> dict[str, Any]:
        """The loader state a checkpoint keeps: before any prompts still in flight."""
        return self.loader.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """What else a checkpoint keeps of this source (the loader's position aside)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (after the restored weights were sent)."""

    def write_account(self, folder: Path, attempt: int, failure: BaseException | None) -> None:
        """Write what became of the prompts this attempt drew (streaming: the ledger).
        Default: nothing (the loader's position says it all)."""

    def take_metrics(self) -> dict[str, float]:
        """Metrics gathered since the last call (syncs run while fetching samples)."""
        metrics, self._metrics = self._metrics, {}
        return metrics


class HybridRollouts(RolloutSource):
    """The actor's in-process rollout engine: generate, update, sync, in that order."""

    def take(self, step: int) -> StepSamples:
        prompts = next(self.loader)
        generated = self.groups.actor.generate(
            generation_input(prompts, self.config), self._params(step)
        )
        return StepSamples(step, prompts, generated, version=step - 1)

    def after_update(self, step: int) -> dict[str, float]:
        return self.sync(step)

    def queue_after_update(self, step: int) -> Callable[[], dict[str, float]]:
        # the sync's dispatch overlaps the update instead of a round trip after it
        future = self.groups.actor.sync_weights.remote()
        return lambda: merge_rank_metrics(future.result())

    def sync(self, version: int) -> dict[str, float]:
        return merge_rank_metrics(self.groups.actor.sync_weights())

    def generate_now(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.groups.actor.generate(prompts, params)


class StandaloneRollouts(RolloutSource):
    """A rollout pool of its own, up to ``rollout.max_staleness`` batches ahead of training."""

    def __init__(self, config: TrainerConfig, groups: RoleGroups, loader: PromptLoader) -> None:
        super().__init__(config, groups, loader)
        if groups.rollout is None:
            raise RuntimeError("placement.mode: standalone spawned no rollout pool")
        self.pool = groups.rollout
        self.max_staleness = config.rollout.max_staleness
        self.total_steps = config.run.total_steps
        self.in_flight: deque[_InFlight] = deque()
        self.rollout_version = 0
        """The policy version the rollout pool holds (it starts from the actor's weights)."""
        self.actor_version = 0
        """Updates the actor has completed (set as steps are taken)."""
        self.dropped_samples = 0
        self._syncs: list[tuple[GroupFuture, GroupFuture]] = []
        """Broadcasts queued on both sides, not yet waited for."""
        self.staleness_counts: dict[int, int] = {}
        """Samples trained on so far, by staleness: the run's staleness histogram."""
        self._connect()

    def _connect(self) -> None:
        """Form the broadcast group: actor rank 0 plus every rollout rank; tell the actor the
        dtype the pool generates in (its rollout correction follows it)."""
        self.groups.actor.follow_rollout_dtype(self.pool.compute_dtype())
        address = self.groups.actor.open_weight_channel(list(self.pool.node_key()))
        joins = [
            self.groups.actor.join_weight_channel.remote(),
            self.pool.join_weight_channel.remote(address),
        ]
        for future in joins:
            future.result()

    # ------------------------------------------------------------ schedule
    def take(self, step: int) -> StepSamples:
        if self.in_flight and self.in_flight[0].step != step:
            raise RuntimeError(f"step {step} expected, batch of step {self.in_flight[0].step} next")
        self.actor_version = step - 1
        if not self.in_flight:
            self._launch(step)
        entry = self.in_flight.popleft()
        for ahead in range(step + 1, min(step + self.max_staleness, self.total_steps) + 1):
            if any(e.step == ahead for e in self.in_flight):
                continue
            if self._needs_sync(ahead) and self._others_pending():
                break  # a sync now would idle the actor behind other generations
            self._launch(ahead)
        generated = entry.future.result()
        staleness = (step - 1) - entry.version
        if staleness > self.max_staleness:  # only if a schedule change outran the bound
            self.dropped_samples += len(generated)
            self.in_flight.clear()  # later batches were generated with older weights still
            self.loader.load_state_dict(entry.loader_state)
            self._launch(step)  # syncs first: the pool is too far behind
            entry = self.in_flight.popleft()
            generated = entry.future.result()
            staleness = (step - 1) - entry.version
        self.staleness_counts[staleness] = self.staleness_counts.get(staleness, 0) + len(generated)
        self._metrics.update(
            {
                **{
                    f"async/samples_at_staleness_{age}": float(self.staleness_counts.get(age, 0))
                    for age in range(self.max_staleness + 1)
                },
                "async/staleness": float(staleness),
                "async/policy_version": float(entry.version),
                # the pool's own account (oldest weights in the batch): equal when the
                # schedule's bookkeeping is right
                "async/rollout_version": float(generated[ROLLOUT_VERSION].min()),
                "async/in_flight": float(len(self.in_flight)),
                "async/dropped_samples": float(self.dropped_samples),
            }
        )
        return StepSamples(step, entry.prompts, generated, entry.version)

    def _needs_sync(self, step: int) -> bool:
        """Whether step ``step``'s batch needs newer weights than the pool holds: it trains at
        version ``step - 1`` and may be at most ``max_staleness`` versions behind."""
        return self.rollout_version < (step - 1) - self.max_staleness

    def _others_pending(self) -> bool:
        """Generations queued for later steps that have not finished."""
        return not all(entry.future.done() for entry in self.in_flight)

    def _launch(self, step: int) -> None:
        """Draw step ``step``'s prompts and queue their generation (syncing first if needed)."""
        if self._needs_sync(step):
            self._start_sync(self.actor_version)  # the pool receives before it generates
        state = self.loader.state_dict()
        prompts = next(self.loader)
        future = self.pool.generate.remote(
            generation_input(prompts, self.config), self._params(step)
        )
        self.in_flight.append(_InFlight(step, prompts, future, self.rollout_version, state))

    # ----------------------------------------------------------------- sync
    def after_update(self, step: int) -> dict[str, float]:
        """The metrics of the syncs started this step; with nothing in flight the pool is
        idle, so the new weights go out now (``k = 0``)."""
        self.actor_version = step
        metrics = self._finish_syncs()
        if not self.in_flight:
            metrics.update(self.sync(step))
        return metrics

    def sync(self, version: int) -> dict[str, float]:
        """Broadcast the actor's weights to the pool and wait for it (the pool first finishes
        the generations queued before)."""
        self._start_sync(version)
        return self._finish_syncs()

    def _start_sync(self, version: int) -> None:
        """Queue the broadcast on both sides without waiting: each side takes calls in order,
        so the actor sends before any update queued later, and the pool loads the weights
        before any generation queued later.  The driver meanwhile scores the current batch."""
        send = self.groups.actor.sync_weights.remote()
        receive = self.pool.receive_weights.remote()
        self._syncs.append((send, receive))
        self.rollout_version = version

    def _finish_syncs(self) -> dict[str, float]:
        """Wait for the queued syncs; their metrics merged (empty if none)."""
        syncs, self._syncs = self._syncs, []
        rows: list[dict[str, float]] = []
        for send, receive in syncs:
            try:
                rows.extend(send.result())
            except WorkerError:
                self._raise_if_pool_lost(receive)  # a dead receiver is the cause, not the sender
                raise
            rows.extend(receive.result())
        if not rows:
            return {}
        metrics = merge_rank_metrics(rows)
        # A whole-model rollout rank holds no training shard: it receives M / (t_g p_g) = M.
        metrics["reshard/bytes_expected"] = metrics.get("reshard/model_bytes", 0.0)
        return metrics

    def _raise_if_pool_lost(self, receive: GroupFuture) -> None:
        """The actor's broadcast failed: if a rollout rank died meanwhile, report that."""
        deadline = time.monotonic() + self.config.cluster.failure_timeout_s
        while not receive.done() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not receive.done():
            return
        try:
            receive.result()
        except WorkerLostError:
            raise
        except WorkerError:
            return

    def generate_now(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.pool.generate(prompts, params)

    def loader_state(self) -> dict[str, Any]:
        return self.in_flight[0].loader_state if self.in_flight else self.loader.state_dict()


def rollout_source(
    config: TrainerConfig, groups: RoleGroups, loader: PromptLoader
) -> RolloutSource:
    """The rollout source the placement and ``rollout.mode`` imply."""
    if groups.rollout is not None and config.rollout.mode == "streaming":
        from hf_core.trainer.streaming_rollouts import StreamingRollouts

        return StreamingRollouts(config, groups, loader)
    if groups.rollout is not None:
        return StandaloneRollouts(config, groups, loader)
    return HybridRollouts(config, groups, loader)
