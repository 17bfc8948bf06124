"""Expert routing of transformers mixture-of-experts models: recorded in a rollout, replayed
in a training forward (routing replay; the arithmetic is :mod:`hf_core.engines.routed_experts`).

transformers (5.x) gives every MoE layer a router module (``Qwen3MoeTopKRouter``,
``MixtralTopKRouter``, ...) that carries ``top_k`` and ``num_experts`` and whose forward
returns ``(router_logits, gate_weights, expert_ids)`` for the layer's flattened tokens.  A
forward hook on each router reads the ids (recording) or replaces the weights and ids with
the recorded experts' (replay); the experts then run on what the hook returned.  Token order
inside a router is the order of the model's ``[rows, columns]`` inputs, flattened.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn

from hf_core.device import collective_device
from hf_core.engines.routed_experts import (
    RoutingStats,
    check_routed_experts,
    expert_load,
    load_balancing_loss,
    recorded_mask,
    replayed_gates,
    router_z_loss,
    routing_dtype,
    same_sets,
)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if _is_router(m)]


def _is_router(module: nn.Module) -> bool:
    return (
        type(module).__name__.endswith("Router")
        and isinstance(getattr(module, "top_k", None), int)
        and isinstance(getattr(module, "num_experts", None), int)
    )


def num_experts(routers: list[nn.Module]) -> int:
    """The largest expert count of the routers (0 without routers)."""
    return max((int(r.num_experts) for r in routers), default=0)


class _RouterHooks:
    """A forward hook of :meth:`_hook`'s on each of the model's routers while the context is
    open (entered, the hooks run after any registered before, e.g. :func:`replaying`'s)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self._handles: list[Any] = []

    def __enter__(self) -> Self:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int) -> Any:
        raise NotImplementedError


class RoutingRecorder(_RouterHooks):
    """Each router's top-k ids of the latest forward; :meth:`take` returns them laid out as
    the forward's ``[rows, columns, layers, k]`` inputs, in :func:`routing_dtype`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.dtype = routing_dtype(num_experts(self.routers))
        self._latest: list[torch.Tensor | None] = [None] * len(self.routers)

    def _hook(self, layer: int) -> Any:
        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            self._latest[layer] = output[2].detach()

        return record

    def take(self, rows: int, columns: int) -> torch.Tensor:
        """The latest forward's ids as ``[rows, columns, layers, k]`` (on the CPU)."""
        per_layer = []
        for layer, ids in enumerate(self._latest):
            if ids is None:
                raise RuntimeError(f"MoE layer {layer}'s router did not run in the forward")
            per_layer.append(ids.reshape(rows, columns, -1))
        self._latest = [None] * len(self.routers)
        return torch.stack(per_layer, dim=2).to(device="cpu", dtype=self.dtype)


def check_routing(routers: list[nn.Module], routed: torch.Tensor) -> None:
    """A :class:`~hf_core.errors.DataError` unless the batch's ``[rows, columns, layers, k]``
    expert ids fit ``routers`` (:func:`moe_routers`): layer count, k, ids in range."""
    check_routed_experts(
        routed, [int(r.num_experts) for r in routers], [int(r.top_k) for r in routers]
    )


@contextmanager
def replaying(
    model: nn.Module,
    routed: torch.Tensor,
    attention_mask: torch.Tensor,
    stats: RoutingStats | None = None,
    group: dist.ProcessGroup | None = None,
) -> Iterator[None]:
    """Forwards of ``model`` inside route every token of the ``[rows, columns]`` inputs to
    its recorded experts (``routed``: ``[rows, columns, layers, k]``).  A forward may take the
    rows as they are or packed as one row of their real tokens in row order
    (:func:`hf_core.engines.sequence_packing.pack_sequences`); the hook tells them apart by
    the layer's token count.  ``stats`` (when given) counts, over real tokens
    (``attention_mask``) with a record, how often the training router chose the recorded set
    itself, and the expert load; each layer once (a recomputation under activation
    checkpointing does not count again).

    Under Ulysses sequence parallelism ``routed`` and ``attention_mask`` are this rank's
    columns of the laid-out micro-batch (:func:`hf_fsdp.ulysses.lay_out_like`) and ``group``
    the ranks that split it: each rank's layers route only its own tokens, and when the
    context closes (after the backward, where a training step holds it) the counts of
    ``stats`` are summed over ``group`` (one all-reduce), so every rank of the group reports
    the whole micro-batch's agreement and per-layer expert load, each real token once, as a
    single rank running it would."""
    if replay_active(model):  # an outer replay (held through the backward) routes already
        yield
        return
    routers = moe_routers(model)
    check_routing(routers, routed)
    real_rows = attention_mask.reshape(-1).bool()
    seen: set[int] = set()
    widest = num_experts(routers)
    pending: dict[int, torch.Tensor] = {}
    """Under ``group``: per layer ``[matching, compared, load per expert...]``, summed over
    the group when the context closes."""

    def count(
        layer: int, own: torch.Tensor, here: torch.Tensor, ids: torch.Tensor, real: Any
    ) -> None:
        assert stats is not None
        counted = real.to(own.device) & recorded_mask(here).all(dim=-1)
        matching = int(same_sets(own[counted], here[counted]).sum())
        load = expert_load(ids[counted], widest).float().cpu()
        if group is not None:
            pending[layer] = torch.cat(
                [torch.tensor([matching, int(counted.sum())], dtype=torch.float64), load.double()]
            )
            return
        stats.matching += matching
        stats.compared += int(counted.sum())
        experts = int(routers[layer].num_experts)
        _add_load(stats, load[:experts])

    def hook(layer: int, router: nn.Module) -> Any:
        rows = routed[:, :, layer].reshape(-1, routed.shape[-1])
        packed = rows[real_rows.to(rows.device)]  # pack_sequences' order: real tokens, row by row
        layouts = {  # tokens the layer routes -> (recorded ids, which of them are real)
            len(packed): (packed, torch.ones(len(packed), dtype=torch.bool)),
            len(rows): (rows, real_rows),
        }

        def replace(_module: nn.Module, _args: Any, output: Any) -> Any:
            logits, weights, own = output
            if own.shape[0] not in layouts:
                raise ValueError(
                    f"MoE layer {layer} routes {own.shape[0]} tokens, the batch recorded "
                    f"{len(rows)} ({len(packed)} real): replay needs the rows as recorded or "
                    "packed by sequence packing"
                )
            recorded, real = layouts[own.shape[0]]
            here = recorded.to(own.device)
            normalize = _normalizes(router, logits, weights, own)
            ids, gates = replayed_gates(logits, here, own, normalize)
            if stats is not None and layer not in seen:
                seen.add(layer)
                count(layer, own, here, ids, real)
            return logits, gates.to(weights.dtype), ids

        return replace

    handles = [r.register_forward_hook(hook(i, r)) for i, r in enumerate(routers)]
    setattr(model, _REPLAY_ACTIVE, True)
    try:
        yield
        if group is not None and stats is not None:
            _combine(stats, pending, routers, group)
    finally:
        setattr(model, _REPLAY_ACTIVE, False)
        for handle in handles:
            handle.remove()


def _add_load(stats: RoutingStats, load: torch.Tensor) -> None:
    if load.sum() > 0:
        stats.load_ratios.append(float(load.max() / load.mean()))


def _combine(
    stats: RoutingStats,
    pending: dict[int, torch.Tensor],
    routers: list[nn.Module],
    group: dist.ProcessGroup,
) -> None:
    """Each layer's counts summed over the sequence-parallel ``group`` into ``stats``.  Every
    rank of the group runs every layer (the attention all-to-alls keep them in step), so
    each has a row for every layer that ran; a layer no forward ran adds nothing."""
    if not pending:  # no forward ran inside: the same on every rank of the group
        return
    layers = sorted(pending)
    counts = torch.stack([pending[layer] for layer in layers])
    device = collective_device()
    counts = counts.to(device)
    dist.all_reduce(counts, group=group)
    for layer, row in zip(layers, counts.cpu(), strict=True):
        stats.matching += int(row[0])
        stats.compared += int(row[1])
        _add_load(stats, row[2 : 2 + int(routers[layer].num_experts)])


_REPLAY_ACTIVE = "_hybridflow_routing_replay"


def replay_active(model: nn.Module) -> bool:
    """Whether a :func:`replaying` context is open on ``model`` (an inner one then does
    nothing).  A training step holds one open through its backward: activation checkpointing
    recomputes each layer's forward there, and a recompute that routed by the trainer's own
    router would run other experts than the forward did (torch's CheckpointError, or wrong
    gradients where the counts happen to agree)."""
    return bool(getattr(model, _REPLAY_ACTIVE, False))


def _normalizes(
    router: nn.Module, logits: torch.Tensor, weights: torch.Tensor, own: torch.Tensor
) -> bool:
    """Whether the router renormalises its top-k probabilities: its ``norm_topk_prob`` where
    it has one, else read off its output (Mixtral always does)."""
    flag = getattr(router, "norm_topk_prob", None)
    if flag is not None:
        return bool(flag)
    plain = torch.softmax(logits.float(), dim=-1).gather(-1, own)
    return not torch.allclose(weights.float(), plain, rtol=1e-3, atol=1e-6)


class RouterLosses(_RouterHooks):
    """The load-balancing and z losses of a forward's MoE layers (the arithmetic:
    :func:`~hf_core.engines.routed_experts.load_balancing_loss`, :func:`router_z_loss`), over
    the tokens where ``real`` (``[tokens]``, the forward's inputs flattened) is True.

    Inside the context a forward hook on each router keeps its logits (with their graph) and
    the ids the layer ran: enter it after :func:`replaying`, so its hook sees the replayed ids.
    Each layer counts once (a recomputation under activation checkpointing does not count
    again).  :meth:`losses` then gives each loss averaged over the layers.

    Under Ulysses sequence parallelism (``group``: the ranks splitting the micro-batch's
    columns; ``real`` this rank's columns of the laid-out real-token mask) each rank sees
    only its own tokens, and the losses are those of the whole micro-batch: the expert slot
    counts and token counts (no gradient) and the sums of router probabilities and of
    ``logsumexp^2`` (with their graph, :func:`hf_fsdp.ulysses.all_reduce_sum`) are summed
    over the group before ``f_e``, ``P_e`` and the means are taken.  Every rank then holds
    the same losses, and the backward sums the group's gradients, as for the gathered
    log-probs.  Two all-reduces per forward (the counts, then the sums)."""

    def __init__(
        self, model: nn.Module, real: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(model)
        self.real = real.reshape(-1).bool()
        self.group = group
        self._seen: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.routers)

    def _hook(self, layer: int) -> Any:
        def keep(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._seen[layer] is None:
                self._seen[layer] = (output[0], output[2].detach())

        return keep

    def losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(load-balancing loss, z-loss)``, each the mean over the MoE layers."""
        aux, z = [], []
        seen_layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer, (router, seen) in enumerate(zip(self.routers, self._seen, strict=True)):
            if seen is None:
                raise RuntimeError(f"MoE layer {layer}'s router did not run in the forward")
            logits, ids = seen
            seen_layers.append(seen)
            if logits.shape[0] != self.real.shape[0]:
                raise ValueError(
                    f"MoE layer {layer} routed {logits.shape[0]} tokens, the forward's token "
                    f"mask has {self.real.shape[0]}"
                )
            if self.group is None:
                aux.append(load_balancing_loss(logits, ids, self.real, int(router.num_experts)))
                z.append(router_z_loss(logits, self.real))
        self._seen = [None] * len(self.routers)
        if self.group is not None:
            aux, z = self._group_losses(seen_layers)
        return torch.stack(aux).mean(), torch.stack(z).mean()

    def _group_losses(
        self, seen: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the load-balancing and z losses over the whole group's real tokens:
        :func:`~hf_core.engines.routed_experts.load_balancing_loss` and
        :func:`~hf_core.engines.routed_experts.router_z_loss` from sums over the ranks."""
        from hf_fsdp.ulysses import all_reduce_sum

        assert self.group is not None
        counts, sums, widths = [], [], []
        for router, (logits, ids) in zip(self.routers, seen, strict=True):
            experts = int(router.num_experts)
            keep = self.real.to(logits.device)
            kept = logits[keep].float()
            chosen = ids[keep].reshape(-1).long()
            slots = torch.bincount(chosen, minlength=experts)[:experts].to(kept.dtype)
            tokens = kept.new_tensor([float(kept.shape[0])])
            counts.append(torch.cat([slots, tokens]))
            probs = torch.softmax(kept, dim=-1).sum(dim=0)  # [experts]
            squares = torch.logsumexp(kept, dim=-1).square().sum()[None]
            sums.append(torch.cat([probs, squares]))
            widths.append(experts)
        total_counts = torch.cat(counts).detach()
        dist.all_reduce(total_counts, group=self.group)
        total_sums = all_reduce_sum(torch.cat(sums), self.group)
        aux, z = [], []
        start = 0
        for experts, sums_here in zip(widths, sums, strict=True):
            count_row = total_counts[start : start + experts + 1]
            sum_row = total_sums[start : start + experts + 1]
            start += experts + 1
            tokens = count_row[experts]
            if float(tokens) == 0:  # no real token in the whole micro-batch
                aux.append(sums_here.sum() * 0.0)
                z.append(sums_here.sum() * 0.0)
                continue
            share = count_row[:experts] / count_row[:experts].sum()
            aux.append(experts * (share * sum_row[:experts] / tokens).sum())
            z.append(sum_row[experts] / tokens)
        return aux, z
