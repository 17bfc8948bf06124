"""Finished sample groups between a streaming rollout pool and the trainer, and the account
of every prompt a run draws.

Streaming (``rollout.mode: streaming``) hands the trainer a prompt's group of ``n`` samples as
soon as its last sample ends, instead of a whole batch when its slowest sample ends.  The
trainer takes ``data.batch_size`` complete groups in the order they finished
(:class:`GroupBuffer`).  With partial rollouts a response may span weight updates, so every
response token carries the policy version of the weights that sampled it
(``token_versions``, ``[n, response_len]``); a group is as old as its oldest token, and a
group more than ``max_staleness`` versions behind the version about to be trained is dropped
and counted, never trained.

:class:`PromptLedger` says what became of each drawn prompt: in flight, trained (at which
step), dropped (why) or lost to a failure, so a run can list them and a resumed run
regenerates exactly the prompts that were in flight.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.engines.streaming import StreamRequest

TOKEN_VERSIONS = "token_versions"
"""Per response token: the policy version of the weights that sampled it."""

PromptId = tuple[int, int]
"""(epoch, the record's ``sample_index``): a prompt drawn again in a later epoch is another id."""


def oldest_versions(token_versions: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per sample, the version of its oldest real token (padding ignored; a sample with no
    token reports the newest version in the batch, so an empty response is never stale)."""
    newest = int(token_versions.max()) if token_versions.numel() else 0
    masked = token_versions.masked_fill(response_mask == 0, newest)
    return masked.min(dim=-1).values if masked.numel() else masked.new_zeros(masked.shape[0])


def version_spread(token_versions: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per sample, newest minus oldest version among its real tokens: > 0 when a weight
    update reached it mid-generation."""
    real = response_mask != 0
    if not token_versions.numel():
        return token_versions.new_zeros(token_versions.shape[0])
    low = token_versions.masked_fill(~real, torch.iinfo(token_versions.dtype).max).min(-1).values
    high = token_versions.masked_fill(~real, torch.iinfo(token_versions.dtype).min).max(-1).values
    return torch.where(real.any(-1), high - low, torch.zeros_like(low))


GroupSamples = Batch | list[StreamRequest]
"""A group's samples: rows of a whole generate call (a :class:`Batch`), or the requests a
token stream finished, turned into rows only when the step takes them (one
:func:`~hf_core.engines.streaming.responses_batch` for the whole step, not one per group)."""


def oldest_requested_version(requests: list[StreamRequest]) -> int | None:
    """The version of the oldest token among ``requests`` (``None``: no token at all)."""
    return min((min(r.versions) for r in requests if r.versions), default=None)


def oldest_row_version(samples: Batch) -> int | None:
    """The version of the oldest real token among ``samples``' rows (``None``: none)."""
    real = samples["response_mask"] != 0
    if not bool(real.any()):
        return None
    return int(samples[TOKEN_VERSIONS][real].min())


@dataclass
class FinishedGroup:
    """One prompt's ``n`` samples, complete."""

    prompt_id: PromptId
    samples: GroupSamples
    oldest: int | None
    """The policy version of its oldest token, computed once as it arrives (``None``: no
    token, never stale)."""


class GroupBuffer:
    """Samples as the pool returns them, grouped by prompt; complete groups wait in the order
    they finished until the trainer takes them."""

    def __init__(self, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self._partial: dict[PromptId, list[Batch]] = {}
        self._ready: deque[FinishedGroup] = deque()

    @property
    def depth(self) -> int:
        """Complete groups waiting."""
        return len(self._ready)

    def add(self, prompt_id: PromptId, samples: Batch) -> FinishedGroup | None:
        """Some of ``prompt_id``'s sample rows; the group once its ``n``-th arrives."""
        parts = self._partial.setdefault(prompt_id, [])
        parts.append(samples)
        have = sum(len(p) for p in parts)
        if have > self.group_size:
            raise ValueError(f"prompt {prompt_id}: {have} samples for groups of {self.group_size}")
        if have < self.group_size:
            return None
        del self._partial[prompt_id]
        rows = Batch.concat(parts)
        group = FinishedGroup(prompt_id, rows, oldest_row_version(rows))
        self._ready.append(group)
        return group

    def add_requests(self, prompt_id: PromptId, requests: list[StreamRequest]) -> FinishedGroup:
        """A complete group of finished stream requests (in sample order)."""
        if len(requests) != self.group_size:
            raise ValueError(
                f"prompt {prompt_id}: {len(requests)} samples for groups of {self.group_size}"
            )
        group = FinishedGroup(prompt_id, requests, oldest_requested_version(requests))
        self._ready.append(group)
        return group

    def take(
        self, count: int, train_version: int, max_staleness: int
    ) -> tuple[list[FinishedGroup], list[FinishedGroup]]:
        """Up to ``count`` groups fresh enough to train at ``train_version`` (oldest token at
        most ``max_staleness`` versions behind), in the order they finished, and the stale
        groups met on the way (dropped: the caller counts them)."""
        kept: list[FinishedGroup] = []
        dropped: list[FinishedGroup] = []
        while self._ready and len(kept) < count:
            group = self._ready.popleft()
            if group.oldest is not None and train_version - group.oldest > max_staleness:
                dropped.append(group)
            else:
                kept.append(group)
        return kept, dropped

    def unfinished(self) -> list[PromptId]:
        """Prompts with some samples but not all (a checkpoint regenerates them)."""
        return list(self._partial)


STATES = ("in_flight", "trained", "dropped", "lost")


class PromptLedger:
    """What became of every prompt the run drew."""

    def __init__(self) -> None:
        self._state: dict[PromptId, str] = {}
        self._detail: dict[PromptId, Any] = {}
        """The step a prompt was trained at, or why it was dropped / lost."""

    def issued(self, ids: list[PromptId]) -> None:
        for pid in ids:
            if self._state.get(pid, "in_flight") != "in_flight":
                raise ValueError(f"prompt {pid} drawn again after it was {self._state[pid]}")
            self._state[pid] = "in_flight"

    def _settle(self, ids: list[PromptId], state: str, detail: Any) -> None:
        for pid in ids:
            now = self._state.get(pid)
            if now != "in_flight":
                raise ValueError(
                    f"prompt {pid} is {now or 'unknown'}, not in flight: cannot be {state}"
                )
            self._state[pid] = state
            self._detail[pid] = detail

    def trained(self, ids: list[PromptId], step: int) -> None:
        self._settle(ids, "trained", step)

    def dropped(self, ids: list[PromptId], reason: str) -> None:
        self._settle(ids, "dropped", reason)

    def withdrawn(self, ids: list[PromptId], reason: str) -> None:
        """Prompts taken for training and then left out of the step (dynamic sampling)."""
        for pid in ids:
            if self._state.get(pid) != "trained":
                raise ValueError(f"prompt {pid} is {self._state.get(pid)}, not just trained")
            self._state[pid] = "dropped"
            self._detail[pid] = reason

    def lost(self, ids: list[PromptId], reason: str) -> None:
        self._settle(ids, "lost", reason)

    def state(self, pid: PromptId) -> str | None:
        return self._state.get(pid)

    def in_flight(self) -> list[PromptId]:
        return [pid for pid, state in self._state.items() if state == "in_flight"]

    def counts(self) -> dict[str, float]:
        """``prompts/<state>`` for every state, as metrics."""
        seen = Counter(self._state.values())
        return {f"prompts/{state}": float(seen.get(state, 0)) for state in STATES}

    def rows(self) -> list[dict[str, Any]]:
        """One row per prompt (epoch, sample_index, state, detail): the run's account."""
        return [
            {"epoch": e, "sample_index": i, "state": s, "detail": self._detail.get((e, i))}
            for (e, i), s in self._state.items()
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state, self._detail = {}, {}
        for row in state["rows"]:
            pid = (int(row["epoch"]), int(row["sample_index"]))
            if row["state"] not in STATES:
                raise ValueError(f"prompt {pid}: unknown state {row['state']!r} in the ledger")
            self._state[pid] = row["state"]
            if row["detail"] is not None:
                self._detail[pid] = row["detail"]
