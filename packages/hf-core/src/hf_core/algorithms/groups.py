"""Group ids for group-relative estimators (GRPO, RLOO) and group-level loss aggregation.

A group is the set of responses sampled for one prompt.  ``Batch.repeat_interleave(n)`` lays a
group out as n consecutive samples, so a group can be named either by its size ``n`` or by a
per-sample id (a tensor of ints, or any hashables such as the ``uid`` strings a batch carries as a
non-tensor).  Both are turned into dense ids 0..G−1 here.

Group statistics use a [G, B] one-hot selection and plain reductions rather than
``index_add_``/``scatter_add_``: those use atomics on CUDA and are not bit-for-bit reproducible.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeAlias

import torch

GroupIndex: TypeAlias = torch.Tensor | Sequence[Hashable]


def group_ids(
    batch_size: int,
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Dense group ids [B] (int64, 0..G−1 in order of first appearance).

    Exactly one of ``index`` (a per-sample group id) or ``group_size`` (groups of ``n``
    consecutive samples) must be given.
    """
    if (index is None) == (group_size is None):
        raise ValueError("give exactly one of index= (per-sample group ids) or group_size=")
    if group_size is not None:
        if group_size < 1 or batch_size % group_size:
            raise ValueError(f"group_size {group_size} does not divide the batch size {batch_size}")
        return torch.arange(batch_size, device=device) // group_size
    assert index is not None
    if isinstance(index, torch.Tensor):
        if index.ndim != 1 or index.shape[0] != batch_size:
            raise ValueError(f"index must have shape ({batch_size},), got {tuple(index.shape)}")
        keys: list[Hashable] = index.tolist()
    else:
        keys = list(index)
        if len(keys) != batch_size:
            raise ValueError(f"index has {len(keys)} entries, batch has {batch_size}")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(key, len(dense)) for key in keys]
    if device is None and isinstance(index, torch.Tensor):
        device = index.device
    return torch.tensor(ids, dtype=torch.long, device=device)


def group_onehot(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[G, B] membership matrix: entry (g, i) is 1 when sample i is in group g."""
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    groups = torch.arange(num_groups, device=ids.device)
    return (groups[:, None] == ids[None, :]).to(dtype)
