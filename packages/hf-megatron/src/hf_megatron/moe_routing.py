"""Routing replay on megatron-core's MoE layers (the arithmetic and the batch key:
:mod:`hf_core.engines.routed_experts`; the transformers counterpart: ``hf_fsdp.moe_routing``).

megatron-core 0.16.1 has a router replay of its own (``moe_enable_routing_replay``,
``megatron.core.transformer.moe.router_replay``), but its instances live in one process-wide
list (an actor and a reference engine in one process would share it), it has no "unrecorded"
marker (a response's last token and padding must route freely) and no statistics.  Its hook
point is what this module uses: ``TopKRouter.router_replay`` is handed to megatron's
``topk_routing_with_score_function``, which asks its ``get_replay_topk(scores, topk, ...)``
for ``(values, ids)`` of each token.  :class:`_Replay` answers with the recorded ids and the
router's own scores at them, so megatron's softmax turns them into gates exactly as Qwen3 does:
with ``norm_topk_prob`` the scores are logits and the softmax over the k of them is the
training router's probabilities renormalised; without, the scores are already the softmax
over all experts.  The router keeps its gradient.

Token order: megatron runs ``[sequence, batch]`` hidden states (token ``s * B + b``) on
rows the engine shifted left past their padding (:func:`hf_megatron.forward.pack_left`); the
recorded ids are laid out as the batch's ``input_ids``, so :func:`packed_routing` shifts and
transposes them the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hf_core.engines.routed_experts import (
    RoutingStats,
    expert_load,
    recorded_mask,
    same_sets,
    unrecorded,
)


def moe_routers(module: nn.Module) -> list[nn.Module]:
    """The megatron model's top-k routers, in layer order (this pipeline stage's)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in module.modules() if isinstance(m, TopKRouter)]


def packed_routing(
    routed: torch.Tensor,
    shift: torch.Tensor,
    rows_to: int | None = None,
    columns_to: int | None = None,
) -> torch.Tensor:
    """``routed`` (``[rows, columns, layers, k]``, columns as ``input_ids``) moved as
    :func:`~hf_megatron.forward.pack_left` moves the tokens (row ``b`` left by ``shift[b]``,
    the freed columns unrecorded), rows repeated up to ``rows_to`` as ``pack_batch`` does,
    then flattened in megatron's token order: ``[columns * rows, layers, k]``."""
    rows, cols = routed.shape[:2]
    shift = shift[:rows].to(torch.long)
    index = torch.arange(cols)[None, :] + shift[:, None]
    inside = index < cols
    gathered = routed.gather(
        1, index.clamp(max=cols - 1)[:, :, None, None].expand(-1, -1, *routed.shape[2:])
    )
    marker = torch.full_like(gathered, unrecorded(routed.dtype))
    moved = torch.where(inside[:, :, None, None], gathered, marker)
    if rows_to is not None and rows_to > rows:
        moved = torch.cat([moved, moved[-1:].expand(rows_to - rows, *moved.shape[1:])])
    if columns_to is not None and columns_to > cols:
        extra = moved.new_full(
            (moved.shape[0], columns_to - cols, *moved.shape[2:]), unrecorded(routed.dtype)
        )
        moved = torch.cat([moved, extra], dim=1)
    return moved.transpose(0, 1).reshape(-1, *routed.shape[2:])


class _Replay:
    """One router's replay for one forward (megatron's ``RouterReplay`` interface)."""

    def __init__(
        self,
        recorded: torch.Tensor,
        real: torch.Tensor,
        num_experts: int,
        stats: RoutingStats | None,
    ) -> None:
        self.recorded, self.real, self.num_experts = recorded, real, num_experts
        self.stats = stats
        self.counted = False
        self.ran: torch.Tensor | None = None
        """The ids the layer ran (tests)."""

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recorded = self.recorded.to(own.device)
        if recorded.shape != own.shape:
            raise ValueError(
                f"a MoE layer routes {tuple(own.shape)} (tokens, k), the batch recorded "
                f"{tuple(recorded.shape)}: replay needs the rows unpacked"
            )
        valid = recorded_mask(recorded).all(dim=-1, keepdim=True)
        ids = torch.where(valid, recorded.to(own.dtype), own)
        if self.stats is not None and not self.counted:
            self.counted = True
            counted = self.real.to(own.device) & valid[:, 0]
            self.stats.matching += int(same_sets(own[counted], ids[counted]).sum())
            self.stats.compared += int(counted.sum())
            load = expert_load(ids[counted], self.num_experts).float()
            if load.sum() > 0:
                self.stats.load_ratios.append(float(load.max() / load.mean()))
        self.ran = ids.detach()
        return scores.gather(1, ids), ids


@contextmanager
def replaying(
    module: nn.Module,
    routed: torch.Tensor,
    real: torch.Tensor,
    first_layer: int,
    stats: RoutingStats | None = None,
) -> Iterator[list[_Replay]]:
    """Forwards of ``module`` (one pipeline stage, whose first MoE layer is model layer
    ``first_layer``) inside route each token to its recorded experts.  ``routed``:
    ``[tokens, model layers, k]`` in megatron's token order (:func:`packed_routing`);
    ``real``: ``[tokens]``, which tokens count in ``stats``."""
    routers = moe_routers(module)
    replays = []
    for offset, router in enumerate(routers):
        layer = first_layer + offset
        recorded = routed[:, layer]
        experts = int(router.config.num_moe_experts)
        replays.append(_Replay(recorded, real, experts, stats))
    previous = [r.router_replay for r in routers]
    for router, replay in zip(routers, replays, strict=True):
        router.router_replay = replay
    try:
        yield replays
    finally:
        for router, old in zip(routers, previous, strict=True):
            router.router_replay = old


def real_tokens(lengths: torch.Tensor, columns: int) -> torch.Tensor:
    """``[columns * rows]`` in megatron's token order: True at each row's real tokens (the
    engine packs rows left, so row ``b``'s first ``lengths[b]`` columns)."""
    mask = torch.arange(columns)[None, :] < lengths[:, None].cpu()
    return mask.transpose(0, 1).reshape(-1)
