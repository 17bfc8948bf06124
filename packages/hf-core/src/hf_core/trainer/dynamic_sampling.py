"""DAPO's dynamic sampling: train only on prompt groups whose rewards differ.

Yu et al. 2025, "DAPO" (arXiv 2503.14476) §3.2, eq. 11: with group-relative advantages
(GRPO and its kin) a group whose ``n`` rewards all agree -- every sample right, or every one
wrong -- has zero advantage everywhere.  It adds no gradient but still counts in the loss's
denominators, so as the policy improves the effective batch shrinks.  Dynamic sampling scores
each step's groups as they arrive, drops the uniform ones and draws more prompts until
``data.batch_size`` mixed groups are in hand (at most ``max_rounds`` extra rounds).

The scores computed here are the step's rewards: the trainer does not score the kept samples
again.  Which prompts were filtered is reported to the rollout source (``discard``), so the
streaming ledger marks them dropped rather than trained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_core.batch import Batch
from hf_core.trainer.batches import concat_prompts, concat_samples
from hf_core.trainer.rollout_source import RolloutSource, StepSamples

FILTERED_REASON = "rewards all equal (dynamic sampling)"
SURPLUS_REASON = "batch already full (dynamic sampling)"


def mixed_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group of ``group_size`` consecutive samples: whether its rewards differ."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not form groups of {group_size}")
    grouped = scores.detach().reshape(-1, group_size)
    return grouped.amax(dim=1) > grouped.amin(dim=1)


@dataclass
class FilledStep:
    """A step's samples after dynamic sampling: only mixed groups (unless rounds ran out)."""

    batch: Batch
    """Per sample: the rollout output joined with its prompt's fields (group-major)."""
    prompts: Batch
    scores: torch.Tensor
    """Per sample reward (rule and reward model), as computed while filtering."""
    metrics: dict[str, float]


class DynamicSampler:
    """Draws rounds of samples from a rollout source until enough groups have mixed rewards.

    ``join``: one round's samples as the per-sample batch the trainer trains on.
    ``score``: the per-sample rewards of such a batch.
    """

    def __init__(
        self,
        rollouts: RolloutSource,
        *,
        batch_size: int,
        group_size: int,
        max_rounds: int,
        join: Callable[[StepSamples], Batch],
        score: Callable[[Batch], torch.Tensor],
    ) -> None:
        self.rollouts = rollouts
        self.batch_size, self.group_size, self.max_rounds = batch_size, group_size, max_rounds
        self.join, self.score = join, score
        self.drawn_total = 0
        self.kept_total = 0

    def fill(self, step: int, first: StepSamples) -> FilledStep:
        """Filter ``first`` (the step's regular draw) and draw more until the batch is full."""
        n = self.group_size
        rounds: list[tuple[StepSamples, Batch, torch.Tensor, torch.Tensor]] = []
        samples, have = first, 0
        while True:
            batch = self.join(samples)
            scores = self.score(batch)
            mixed = mixed_groups(scores, n)
            rounds.append((samples, batch, scores, mixed))
            have += int(mixed.sum())
            if have >= self.batch_size or len(rounds) > self.max_rounds:
                break
            samples = self.rollouts.take_more(step, len(rounds), self.batch_size - have)
        # Mixed groups first, in the order drawn; uniform ones only if rounds ran out.
        order = [
            (r, int(g))
            for want in (True, False)
            for r, (_, _, _, mixed) in enumerate(rounds)
            for g in (mixed == want).nonzero().flatten()
        ]
        chosen = set(order[: self.batch_size])
        parts = []
        for r, (samples, batch, scores, mixed) in enumerate(rounds):
            picked = [g for g in range(len(mixed)) if (r, g) in chosen]
            rest = [g for g in range(len(mixed)) if (r, g) not in chosen]
            self.rollouts.discard(samples, [g for g in rest if not mixed[g]], FILTERED_REASON)
            self.rollouts.discard(samples, [g for g in rest if mixed[g]], SURPLUS_REASON)
            if picked:
                parts.append(_groups(batch, samples.prompts, scores, torch.tensor(picked), n))
        drawn = sum(len(mixed) for *_, mixed in rounds)
        kept = min(have, self.batch_size)
        self.drawn_total += drawn
        self.kept_total += kept
        batch = concat_samples([part[0] for part in parts])
        prompts = concat_prompts([part[1] for part in parts])
        scores = torch.cat([part[2] for part in parts])
        batch["group_index"] = torch.arange(len(prompts)).repeat_interleave(n)
        metrics = {
            "dynamic_sampling/rounds": float(len(rounds)),
            "dynamic_sampling/groups_drawn": float(drawn),
            "dynamic_sampling/groups_kept": float(kept),
            "dynamic_sampling/short_groups": float(self.batch_size - kept),
            # measured on what trains, not assumed: 0 unless rounds ran out
            "dynamic_sampling/uniform_groups_trained": float((~mixed_groups(scores, n)).sum()),
            "dynamic_sampling/kept_frac": kept / max(1, drawn),
            "dynamic_sampling/groups_drawn_total": float(self.drawn_total),
            "dynamic_sampling/groups_kept_total": float(self.kept_total),
        }
        return FilledStep(batch, prompts, scores, metrics)


def _groups(
    batch: Batch, prompts: Batch, scores: torch.Tensor, groups: torch.Tensor, n: int
) -> tuple[Batch, Batch, torch.Tensor]:
    """The samples, prompts and scores of the groups ``groups`` (group-major order kept)."""
    rows = (groups[:, None] * n + torch.arange(n)).flatten()
    return batch.index(rows), prompts.index(groups), scores[rows]
