"""The global counts a loss scales itself by: what training engines put in ``micro_batch.meta``.

Engines sum the gradients of their micro-batches and average them over the data-parallel
replicas, so a loss defined over the whole mini-batch (one optimizer step's rows on every
replica) is computed per micro-batch as that micro-batch's share of it (see
:mod:`hf_core.roles.losses`).  The share needs counts over the whole mini-batch, which no
micro-batch sees; :func:`loss_totals` computes them once, the same way for every backend:

* ``global_batch_size``: rows;
* ``global_response_tokens``: response tokens (non-zero ``response_mask`` entries);
* ``global_nonempty_rows``: rows with at least one response token (the denominator of the
  sequence means: a row masked out whole, e.g. by overlong filtering, weighs nothing);
* ``global_response_length``: the widest ``response_mask`` (micro-batches are trimmed to their
  own longest response, so this is the constant L of ``seq-mean-token-sum-norm``);
* ``global_group_tokens`` (batches carrying ``group_index``): response tokens per group id,
  a list indexed by the id (the denominators of ``group-mean-token-mean``).

Every replica counts once: a reduction over ranks that hold copies of one replica's data
(tensor-, pipeline- or sequence-parallel ranks) must divide the sums by the copies
(:func:`all_reduce_over`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from hf_core.batch import Batch

ReduceOp = Literal["sum", "max"]
Reduce = Callable[[torch.Tensor, ReduceOp], torch.Tensor]
"""``reduce(counts, op)``: an int64 vector summed (or maximised) over the data-parallel
replicas, each replica once; returned on the CPU."""

GROUP_KEY = "group_index"
"""The per-row group id (one prompt's responses share it), as the trainer names it."""

TOTAL_KEYS = (
    "global_batch_size",
    "global_response_tokens",
    "global_nonempty_rows",
    "global_response_length",
)


def _mask(batch: Batch) -> torch.Tensor | None:
    return batch["response_mask"] if "response_mask" in batch else None


def _group_ids(batch: Batch) -> torch.Tensor | None:
    if GROUP_KEY not in batch:
        return None
    ids = batch[GROUP_KEY]
    if ids.ndim != 1 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"batch[{GROUP_KEY!r}] must be a 1-D integer tensor of group ids, got "
            f"{ids.dtype} of shape {tuple(ids.shape)}"
        )
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"batch[{GROUP_KEY!r}] holds a negative group id ({int(ids.min())})")
    return ids.to("cpu", torch.int64)


def _spans(batch: Batch) -> list[int]:
    """[response width, group ids span] of one batch: what is maximised over replicas."""
    mask = _mask(batch)
    ids = _group_ids(batch)
    width = int(mask.shape[1]) if mask is not None and mask.ndim == 2 else 0
    groups = int(ids.max()) + 1 if ids is not None and ids.numel() else 0
    return [width, groups]


def _counts(batch: Batch, groups: int) -> torch.Tensor:
    """[rows, tokens, non-empty rows, tokens of group 0..groups-1] of one batch."""
    mask = _mask(batch)
    if mask is None or mask.ndim != 2:
        row_tokens = torch.zeros(len(batch), dtype=torch.int64)
    else:
        row_tokens = (mask != 0).sum(dim=-1).to("cpu", torch.int64)
    head = torch.tensor(
        [len(batch), int(row_tokens.sum()), int((row_tokens > 0).sum())], dtype=torch.int64
    )
    per_group = torch.zeros(groups, dtype=torch.int64)
    ids = _group_ids(batch)
    if ids is not None and ids.numel():
        per_group.index_add_(0, ids, row_tokens)  # integer sums: exact in any order
    return torch.cat([head, per_group])


def loss_totals(parts: Sequence[Batch], reduce: Reduce | None = None) -> dict[str, Any]:
    """The meta entries of the module docstring for the mini-batch made of ``parts``.

    ``parts``: this process's share of the mini-batch (one batch per replica it trains: a
    single one, or every rank's under leader training).  ``reduce``: how this process's
    counts combine with the other replicas' (:func:`all_reduce_over`); ``None`` when
    ``parts`` are the whole mini-batch.  With ``reduce`` every replica must call this
    together (it runs two collectives).
    """
    if not parts:
        raise ValueError("loss_totals needs at least one batch")
    spans = torch.tensor([max(values) for values in zip(*map(_spans, parts), strict=True)])
    if reduce is not None:
        spans = reduce(spans, "max")
    width, groups = (int(v) for v in spans)
    counts = torch.stack([_counts(part, groups) for part in parts]).sum(dim=0)
    if reduce is not None:
        counts = reduce(counts, "sum")
    values = [int(v) for v in counts]
    totals: dict[str, Any] = dict(zip(TOTAL_KEYS, [*values[:3], width], strict=True))
    if groups:
        totals["global_group_tokens"] = values[3:]
    return totals


def all_reduce_over(
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    copies: int = 1,
) -> Reduce:
    """A :data:`Reduce` through ``torch.distributed`` over ``group`` (default: the world),
    on ``device`` (the backend's collective device); sums are divided by ``copies``, the
    ranks of ``group`` that hold the same replica's batch (e.g. sequence-parallel ranks)."""

    def reduce(counts: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        out = counts.to(device)
        dist.all_reduce(
            out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group
        )
        if op == "sum" and copies != 1:
            out = out // copies
        return out.cpu()

    return reduce
