"""GKD's mixed on/off-policy distillation (``algorithm.distill.on_policy_share``, its lambda).

Agarwal et al. 2024 (arXiv 2306.13649) train on the student's own samples with probability
lambda and on fixed completions otherwise.  Here the mix is per prompt group within each
step: a seeded draw picks ``round((1 - lambda) * prompts)`` prompts whose samples are
replaced by the prompt's dataset completion (``completion_key``, repeated for each of its
``n`` rows), so every step carries both.  The teacher then scores those rows like any other
(its top-k at every completion token), and the top-k loss teaches the student the teacher's
distribution along the completion.  Off-policy rows carry no policy-gradient signal: their
advantages are zeroed by the trainer, and their ``rollout_log_probs`` are the student's own
(computed by the actor before the step's other forwards), so the rollout correction sees a
ratio of 1 there.  The rollout still generates for every prompt of the step: the replaced
samples are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.trainer.batches import concat_samples, sft_batch

OFF_POLICY_KEY = "off_policy"
"""Per row: 1 where the response is a dataset completion, not a student sample."""

VERSIONED = frozenset({"token_versions", "policy_version", "rollout_version"})
"""Per-sample keys a dataset completion gets filled with the step's policy version."""
ZEROED = frozenset({"rollout_log_probs", "interrupted"})
"""Per-sample keys a dataset completion gets as 0: its log-probs (computed once the rows are
mixed) and a streaming pool's flag of a response that spanned an update (none did)."""


@dataclass(frozen=True)
class MixedBatch:
    batch: Batch
    """On-policy groups first, then the completions' groups; ``group_index`` renumbered."""
    off_policy: torch.Tensor
    """``[rows]`` bool: the completions' rows."""


def off_policy_prompts(prompts: int, on_policy_share: float, seed: int, step: int) -> torch.Tensor:
    """``[prompts]`` bool: which prompts take their dataset completion this step (a seeded
    draw, so a resumed run mixes as a straight run did)."""
    count = round((1.0 - on_policy_share) * prompts)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    chosen = torch.randperm(prompts, generator=gen)[:count]
    mask = torch.zeros(prompts, dtype=torch.bool)
    mask[chosen] = True
    return mask


def mix_in_completions(
    batch: Batch,
    prompts: Batch,
    off: torch.Tensor,
    *,
    n: int,
    tokenizer: Any,
    completion_key: str,
    version: int,
) -> MixedBatch:
    """``batch`` (group-major, ``n`` rows per prompt) with the groups of the ``off`` prompts
    replaced by their dataset completions."""
    if completion_key not in prompts.non_tensors:
        raise KeyError(
            f"algorithm.distill.completion_key: the dataset has no field {completion_key!r} "
            f"(its fields: {', '.join(sorted(prompts.non_tensors)) or 'none'})"
        )
    rows_off = off.repeat_interleave(n)
    kept = [key for key in batch.keys() if key != "group_index"]  # renumbered below
    on = batch.select(*kept).index(torch.nonzero(~rows_off).flatten())
    chosen = prompts.index(torch.nonzero(off).flatten())
    completions = sft_batch(chosen, tokenizer, completion_key).repeat_interleave(n)
    completions = completions | chosen.select(*chosen.non_tensors).repeat_interleave(n)
    width = completions["responses"].shape[1]
    for key in on.keys():
        if key in completions:
            continue
        if key not in VERSIONED | ZEROED:
            raise ValueError(
                f"algorithm.distill.on_policy_share < 1: the samples carry {key!r}, which a "
                "dataset completion cannot (use on_policy_share: 1 with this rollout)"
            )
        fill = float(version) if key in VERSIONED else 0.0
        like = on[key]
        shape = (len(completions), width) if like.dim() == 2 else (len(completions),)
        values = torch.full(shape, fill, dtype=like.dtype)
        if key == "token_versions":  # padding columns carry no version, as a pool's do
            values = values.masked_fill(completions["response_mask"] == 0, -1)
        completions[key] = values
    mixed = concat_samples([on, completions]) if len(on) else completions
    groups = len(mixed) // n
    mixed["group_index"] = torch.arange(groups).repeat_interleave(n)
    flags = torch.cat(
        [torch.zeros(len(on), dtype=torch.bool), torch.ones(len(completions), dtype=torch.bool)]
    )
    mixed.meta.update(batch.meta)
    return MixedBatch(mixed, flags)


def mixed_prompts(prompts: Batch, off: torch.Tensor) -> Batch:
    """The prompts in :func:`mix_in_completions`' row order (on-policy ones first)."""
    order = torch.cat([torch.nonzero(~off).flatten(), torch.nonzero(off).flatten()])
    return prompts.index(order)
