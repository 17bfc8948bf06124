"""CPU ranks on one host decode as one: the host's first rank generates every rank's prompts
with all the ranks' threads while the others wait (CPU only).

Why: decoding is bound by reading the weights, once per generated token.  Ranks that each decode
their share of the batch each read every weight, so two processes of one thread decoding half
the rows each took longer a step than one process of two threads decoding all of them, even with
the weights in one shared file (docs/performance.md, "Measured choices").  Decoding the host's
prompts on its leader reads the weights once per step with the same cores; the waiting ranks block
in a gloo receive, which takes no CPU.

The ranks' prompt batches are gathered (token ids: small), decoded together, and each rank
gets back exactly its rows, with its own prompt width.  Every rank of the group must call
``generate`` at the same time, equally often, as core's single-turn rollout does: so it is
asked for (``rollout.engine.cpu_leader_generation: true``), never on by default, and left off
for an agent loop or the policy endpoint, whose ranks call ``generate`` their own numbers of
times.  The engine's token streams decode per rank whatever the setting.  Used only when
every rank of the default process group is on this host and computes on the CPU; GPUs and
multi-host groups decode per rank.  Proven equal to per-rank decoding by
``packages/hf-fsdp/tests/test_cpu_leader_rollout.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_core.batch import Batch
from hf_fsdp.cpu_leader import LeaderGroup, split_rows

PROMPT_WIDTH_KEYS = ("input_ids", "attention_mask", "position_ids")
"""Prompt-batch keys of width ``prompt_len`` (left-padded)"""
OUTPUT_WIDTH_KEYS = ("prompts", "input_ids", "attention_mask", "position_ids")
"""Rollout-output keys whose leading columns are the prompt's (left padding first)"""


class LeaderGeneration:
    """Generation on the leader of the default process group (all on one host)."""

    def __init__(self, ranks: LeaderGroup) -> None:
        self.ranks = ranks

    @classmethod
    def for_this_process(cls, device: torch.device) -> LeaderGeneration | None:
        """Leader generation for this engine, or None (a GPU, no process group, one rank, or ranks
        on several hosts).  Collective: every rank of the group builds its engine."""
        ranks = LeaderGroup.for_this_process(device)
        return None if ranks is None else cls(ranks)

    def generate(self, prompts: Batch, decode: Callable[[Batch], Batch]) -> Batch:
        """``decode`` (the engine's own generate, closed over its sampling settings) of every
        rank's ``prompts`` on rank 0; this rank's rows of the result."""

        def decode_all(parts: list[Batch]) -> list[Batch]:
            width = max(_width(p) for p in parts)
            whole = Batch.concat([_left_pad(p, width) for p in parts])
            out = decode(whole)
            rows_per_prompt = len(out) // len(whole) if len(whole) else 1
            pieces = split_rows(out, [len(part) * rows_per_prompt for part in parts])
            return [
                _trim_left(piece, width - _width(part))
                for piece, part in zip(pieces, parts, strict=True)
            ]

        mine: Batch = self.ranks.lead(prompts, decode_all, scatter=True)
        return mine


def _width(batch: Batch) -> int:
    return int(batch["input_ids"].shape[1])


def _left_pad(batch: Batch, width: int) -> Batch:
    """``batch`` with its prompt-width keys left-padded to ``width`` columns (mask 0)."""
    extra = width - _width(batch)
    if extra == 0:
        return batch
    out = batch.select(*batch.keys())
    for key in PROMPT_WIDTH_KEYS:
        if key in batch:
            value = batch[key]
            assert isinstance(value, torch.Tensor)
            pad = value.new_zeros(value.shape[0], extra)
            out[key] = torch.cat([pad, value], dim=1)
    return out


def _trim_left(batch: Batch, columns: int) -> Batch:
    """Drop ``columns`` leading (padding) columns of the output's prompt-width keys."""
    if columns == 0:
        return batch
    for key in OUTPUT_WIDTH_KEYS:
        if key in batch:
            value = batch[key]
            assert isinstance(value, torch.Tensor)
            batch[key] = value[:, columns:].contiguous()
    return batch
