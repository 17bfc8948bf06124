"""Scripted mixture-of-experts routing for rollout engines in core's unit tests.

A scripted engine adds ``routed_experts`` to its output with :func:`add_scripted_routing`: each
fed token's "experts" are a function of the token, its position and the engine call, so a
context fed again by a later call is routed differently there.  :func:`first_feeding_calls`
then says which call first fed each position of a final sequence: what routing replay's
"first forward wins" rule (:func:`hf_core.engines.routed_experts.keep_first_routing`) keeps.
"""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY


def scripted_experts(token: int, position: int, call: int, layers: int = 2) -> list[list[int]]:
    """The top-2 "experts" of a token (ids below 7) at each of ``layers`` MoE layers."""
    return [
        [(token + position + 5 * call + j + 2 * layer) % 7 for j in range(2)]
        for layer in range(layers)
    ]


def add_scripted_routing(out: Batch, call: int, layers: int = 2) -> list[list[int]]:
    """Put the scripted routing of ``out``'s fed tokens (every real token but each row's last)
    under ``routed_experts`` (uint8, 255 where nothing was fed); returns each row's fed ids."""
    rows, columns = out["input_ids"].shape
    routed = torch.full((rows, columns, layers, 2), 255, dtype=torch.uint8)
    fed_rows = []
    for row in range(rows):
        real = out["attention_mask"][row].nonzero().flatten()[:-1]  # the last is not fed
        ids = out["input_ids"][row, real].tolist()
        fed_rows.append(ids)
        for position, (column, token) in enumerate(zip(real.tolist(), ids, strict=True)):
            routed[row, column] = torch.tensor(scripted_experts(token, position, call, layers))
    out[ROUTED_EXPERTS_KEY] = routed
    return fed_rows


def first_feeding_calls(sequence: list[int], fed: list[list[list[int]]]) -> dict[int, int]:
    """Position -> the first call (index into ``fed``: per call, each row's fed ids) whose row
    fed a prefix of ``sequence`` covering that position."""
    first: dict[int, int] = {}
    for call, rows in enumerate(fed):
        for ids in rows:
            if sequence[: len(ids)] == ids:
                for position in range(len(ids)):
                    first.setdefault(position, call)
    return first


def assert_first_routing(
    batch: Batch, row: int, fed: list[list[list[int]]], layers: int = 2
) -> int:
    """Check row ``row`` of ``batch``: every fed position carries the scripted experts of the
    first call that fed it, every other column the unrecorded marker; returns how many calls
    after the first fed part of it."""
    routed = batch[ROUTED_EXPERTS_KEY]
    real = batch["attention_mask"][row].nonzero().flatten()
    sequence = batch["input_ids"][row, real].tolist()
    first = first_feeding_calls(sequence, fed)
    assert len(first) == len(sequence) - 1, "a token other than the last was never fed"
    for position, column in enumerate(real.tolist()[:-1]):
        want = scripted_experts(sequence[position], position, first[position], layers)
        assert routed[row, column].tolist() == want, (row, position)
    unfed = torch.ones(routed.shape[1], dtype=torch.bool)
    unfed[real[:-1]] = False
    assert (routed[row, unfed] == 255).all(), f"row {row}: experts where nothing was fed"
    return len(set(first.values())) - 1
