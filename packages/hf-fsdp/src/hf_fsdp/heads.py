"""Forward passes per head kind, turning HF model outputs into the batch keys core expects.

All per-token outputs cover the response tokens only, shape ``[B, response_len]``:

* ``lm``: ``log_probs`` of each response token under ``softmax(logits / temperature)`` (raw
  logits when ``temperature == 0``, the greedy convention of ``SamplingParams``) and the
  ``entropy`` of that distribution; position ``t`` is predicted from the logits one step
  earlier.  When the micro-batch's float32 logits would exceed ``logits_budget_bytes`` the
  head runs in token chunks on the hidden states
  (:mod:`hf_core.algorithms.chunked_head`), so memory does not grow with vocab x tokens.
* ``value``: ``values[:, t]`` is the value head at the position just before response token
  ``t`` (the state in which the token was chosen), the usual PPO/GAE alignment.
* ``score``: one ``scores`` value per sequence, read at its last non-pad token (the last 1 of
  ``attention_mask``), so left-padded prompts and right-padded responses both work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_core.algorithms import token_log_probs_and_entropy
from hf_core.algorithms.chunked_head import (
    DEFAULT_LOGITS_BUDGET_BYTES,
    TiedHeadGradient,
    chunked_head,
    logits_chunk_tokens,
    tied_embedding,
)
from hf_core.algorithms.token_log_probs import top_k_log_probs
from hf_core.batch import Batch
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, unrecorded
from hf_core.engines.sequence_packing import PACKABLE_ATTENTION as SEQUENCE_PACKABLE
from hf_core.engines.sequence_packing import pack_sequences, sequence_packing_pays
from hf_core.engines.shared_prefix import PackedPrefixes, pack_shared_prefixes
from hf_core.engines.top_k import (
    TEACHER_TOP_K_IDS,
    TOP_K_IDS,
    TOP_K_LOG_PROBS,
    scored_ids,
    split_scored,
)
from hf_core.multimodal import (
    MULTI_MODAL_KEY,
    has_images,
    images_in_prompt_only,
    multimodal_model_inputs,
)
from hf_fsdp import cpu_half, ulysses
from hf_fsdp.config import HeadKind
from hf_fsdp.moe_routing import RouterLosses, RoutingStats, moe_routers, replaying
from hf_fsdp.onednn_linear import OneDNNLinear
from hf_fsdp.onednn_linear import linear as onednn_linear

OUTPUT_KEYS: dict[HeadKind, tuple[str, ...]] = {
    "lm": ("log_probs", "entropy"),
    "value": ("values",),
    "score": ("scores",),
}


def position_ids_of(batch: Batch) -> torch.Tensor:
    """The batch's ``position_ids``, or ones counted from each row's first real token."""
    if "position_ids" in batch:
        return batch["position_ids"]
    mask = batch["attention_mask"].long()
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _model_inputs(model: nn.Module, batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device)
    if has_images(batch):  # a vision-language model: images and 3-D rotary positions
        features = list(batch[MULTI_MODAL_KEY])
        width = _prompt_width(batch)
        return multimodal_model_inputs(model, input_ids, attention_mask, features, width)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_of(batch).to(device),
    }


def _prompt_width(batch: Batch) -> int | None:
    """Columns before the responses (``None``: a prompt-only batch)."""
    if "responses" not in batch:
        return None
    return int(batch["input_ids"].shape[1]) - response_length(batch)


def _images_in_prompt(model: nn.Module, batch: Batch) -> AbstractContextManager[None]:
    """Image features go to the prompts' image slots only (:func:`images_in_prompt_only`)."""
    width = _prompt_width(batch)
    if not has_images(batch) or width is None:
        return nullcontext()
    return images_in_prompt_only(model, width)


PACKABLE_ATTENTION = frozenset({"sdpa", "eager"})
"""Attention implementations that take a ready 4D mask (packed rows' block mask)."""


def packed_inputs(
    model: nn.Module, batch: Batch, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int] | None:
    """The micro-batch with each prompt group packed into one row
    (:mod:`hf_core.engines.shared_prefix`), the index of the position that predicts each
    response token, and the padding positions it computes; ``None`` where packing does not
    apply or pay."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in PACKABLE_ATTENTION or "responses" not in batch or has_images(batch):
        return None
    packed = pack_shared_prefixes(
        batch["input_ids"],
        batch["attention_mask"],
        position_ids_of(batch),
        response_length(batch),
        int(config.get_text_config().hidden_size),  # type: ignore[union-attr]
    )
    if packed is None:
        return None
    inputs = _as_model_inputs(packed, implementation, model, device)
    return inputs, packed.predict_from.to(device), packed.padding


def sequence_packed_inputs(
    model: nn.Module, batch: Batch, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int] | None:
    """The micro-batch as one row of its real tokens (:mod:`hf_core.engines.sequence_packing`)
    and the index of the position that predicts each response token; ``None`` where packing
    does not apply (images, prompt-only batches, another attention implementation) or pay."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in SEQUENCE_PACKABLE or "responses" not in batch or has_images(batch):
        return None
    mask = batch["attention_mask"]
    rows, width = mask.shape
    real = int(mask.sum())
    hidden = int(config.get_text_config().hidden_size)  # type: ignore[union-attr]
    if not sequence_packing_pays(rows, width, real, hidden, str(implementation)):
        return None
    packed = pack_sequences(
        batch["input_ids"], mask, position_ids_of(batch), response_length(batch)
    )
    inputs = {  # no attention_mask: transformers masks by the restarting positions
        "input_ids": packed.input_ids.to(device),
        "position_ids": packed.position_ids.to(device),
    }
    return inputs, packed.predict_from.to(device), 0


def _as_model_inputs(
    packed: PackedPrefixes, implementation: str, model: nn.Module, device: torch.device
) -> dict[str, torch.Tensor]:
    mask = packed.attention_mask.to(device)
    if implementation == "eager":  # eager adds the mask to the scores
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return {
        "input_ids": packed.input_ids.to(device),
        "attention_mask": mask,
        "position_ids": packed.position_ids.to(device),
    }


def response_length(batch: Batch) -> int:
    if "responses" not in batch:
        raise KeyError(
            f"batch needs 'responses' for per-token outputs; it has {sorted(batch.keys())}"
        )
    return int(batch["responses"].shape[1])


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` (and entropy) under ``softmax(logits / temperature)``."""
    return token_log_probs_and_entropy(_tempered(logits, temperature), tokens, with_entropy)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits


@dataclass
class TopK:
    """A forward's own top-k ids and log-probs per position (``k`` 0: not asked for)."""

    k: int = 0
    ids: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None

    def outputs(self) -> dict[str, torch.Tensor]:
        """The output keys (none when ``k`` is 0)."""
        if not self.k:
            return {}
        assert self.ids is not None and self.log_probs is not None
        return {TOP_K_IDS: self.ids, TOP_K_LOG_PROBS: self.log_probs}

    def from_logits(self, logits: torch.Tensor, temperature: float) -> None:
        if self.k:
            self.log_probs, self.ids = top_k_log_probs(_tempered(logits, temperature), self.k)


CHUNKABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
"""Families whose causal-LM forward returns the head's output untouched (no logit soft-capping
or scaling after ``lm_head``), so the head may be replaced by the chunked log-prob node."""


def _scored_log_probs(scored: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The log-probs of a head pass's ``[..., m + 1]`` output (the entropy is last): one per
    position for ``[..., ]`` targets, ``m`` for ``[..., m]`` ones."""
    log_probs = scored[..., :-1]
    return log_probs if targets.dim() == scored.dim() else log_probs[..., 0]


def _chunkable_head(model: nn.Module) -> nn.Module | None:
    """The model's bias-free output projection, when its family allows chunking."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in CHUNKABLE_MODEL_TYPES:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "bias", None) is not None:
        return None
    return head if isinstance(getattr(head, "weight", None), torch.Tensor) else None


def _response_positions(states: torch.Tensor, predict_from: torch.Tensor | None) -> torch.Tensor:
    """``[B, R, ...]``: the states (hidden, logits, values) that predict each response token,
    from a plain forward's last ``R + 1`` positions or a packed one's index."""
    if predict_from is None:
        return states[:, :-1]
    return states.reshape(-1, *states.shape[2:])[predict_from]


def _tied_input_embedding(model: nn.Module, head: nn.Module) -> nn.Embedding | None:
    """The model's input embedding when it is a plain lookup sharing ``head``'s weight."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embed, nn.Embedding) or embed.weight is not head.weight:
        return None
    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        return None
    return embed


@contextmanager
def _head_as_log_probs(
    model: nn.Module,
    head: nn.Module,
    tokens: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk: int,
    predict_from: torch.Tensor | None,
    top_k: TopK | None = None,
) -> Iterator[None]:
    """Make ``head`` return ``[B, R, m + 1]`` (the log-probs of ``tokens``' ``m`` ids per
    position, then the entropy) instead of logits; ``top_k`` receives the positions' own
    top-k (no gradient).

    The result goes out as the model's ``logits``, so it stays an output of the model's
    forward: FSDP's backward hooks, registered on forward outputs, see it as they saw logits.
    A tied input embedding adds its gradient into the head's in place
    (:class:`~hf_core.algorithms.chunked_head.TiedHeadGradient`).
    """
    embed = _tied_input_embedding(model, head)
    share = TiedHeadGradient() if embed is not None else None
    ids = tokens if tokens.dim() == 3 else tokens.unsqueeze(-1)

    def forward(hidden: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
        out = chunked_head(
            _response_positions(hidden, predict_from),
            head.weight,
            ids,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk=chunk,
            kernel=cpu_half.head_kernel(
                onednn_linear if isinstance(head, OneDNNLinear) else F.linear
            ),
            share=share,
            top_k=top_k.k if top_k is not None else 0,
        )
        if top_k is not None:
            top_k.ids, top_k.log_probs = out.top_k_ids, out.top_k_log_probs
        entropy = out.log_probs[..., :1] if out.entropy is None else out.entropy.unsqueeze(-1)
        return torch.cat([out.log_probs, entropy], dim=-1)

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        assert embed is not None and share is not None
        return tied_embedding(ids, embed.weight, embed.padding_idx, share)

    head.forward = forward  # type: ignore[method-assign]
    if embed is not None:
        embed.forward = lookup  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward
        if embed is not None:
            del embed.forward


def routing_replay(
    model: nn.Module,
    batch: Batch,
    tokens: ForwardTokens | None,
    group: torch.distributed.ProcessGroup | None = None,
    sequence_packing: bool = True,
) -> AbstractContextManager[None]:
    """The rollout's experts for forwards inside when the batch carries them
    (:mod:`hf_fsdp.moe_routing`); agreement and load counted in ``tokens``.  A training step
    holds it open through its backward (activation checkpointing recomputes the forward
    there); the forward's own then does nothing.

    ``group``: the Ulysses sequence-parallel group the forwards split the micro-batch over
    (``sequence_packing``: its layout, :func:`hf_fsdp.ulysses.lay_out`); the routing is then
    laid out as ``input_ids`` are and this rank replays its own columns
    (:func:`sequence_parallel_routing`), the counts summed over the group when it closes."""
    if ROUTED_EXPERTS_KEY not in batch:
        return nullcontext()
    stats = tokens.routing if tokens is not None else None
    if group is None:
        return replaying(model, batch[ROUTED_EXPERTS_KEY], batch["attention_mask"], stats)
    routed, real = sequence_parallel_routing(batch, group, sequence_packing)
    return replaying(model, routed, real, stats, group=group)


def sequence_parallel_routing(
    batch: Batch, group: torch.distributed.ProcessGroup, sequence_packing: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's columns of the batch's ``routed_experts`` laid out as
    :func:`hf_fsdp.ulysses.lay_out` lays out ``input_ids`` (padding columns unrecorded), and
    of the real-token mask laid out the same way: ``[rows', L / S, layers, k]`` and
    ``[rows', L / S]``."""
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    routed, mask = batch[ROUTED_EXPERTS_KEY], batch["attention_mask"]
    laid = ulysses.lay_out_like(routed, mask, size, sequence_packing, unrecorded(routed.dtype))
    real = ulysses.lay_out_like(mask.bool(), mask, size, sequence_packing, False)
    width = laid.shape[1] // size
    columns = slice(rank * width, (rank + 1) * width)
    return laid[:, columns], real[:, columns]


def lm_forward(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    temperature: float,
    with_entropy: bool,
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
    shared_prefix: bool = True,
    tokens: ForwardTokens | None = None,
    sequence_packing: bool = True,
    top_k: int = 0,
) -> dict[str, torch.Tensor]:
    """``log_probs`` (and ``entropy``) of the responses; with the batch's teacher top-k ids
    also the log-probs at them (:mod:`hf_core.engines.top_k`), and with ``top_k`` the
    model's own top-k ids and log-probs per response position."""
    responses = batch["responses"].to(device)
    targets = scored_ids(batch, responses)
    own = TopK(top_k)
    replay = routing_replay(model, batch, tokens)
    if ROUTED_EXPERTS_KEY in batch:  # each sample's own prompt tokens: no shared prefixes
        shared_prefix = False
    # a training forward (``tokens``) of an MoE model measures its router losses over every
    # row's real tokens: shared prompts are not packed (sequence packing keeps each once)
    router_losses = tokens is not None and bool(moe_routers(model))
    if router_losses:
        shared_prefix = False
    inputs, predict_from, keep = _inputs_and_positions(
        model, batch, device, shared_prefix, tokens, sequence_packing
    )
    losses = RouterLosses(model, _real_tokens(inputs)) if router_losses else None
    replay = _then(replay, losses)
    head = _chunkable_head(model)
    vocab = int(head.weight.shape[0]) if head is not None else 0
    chunk = logits_chunk_tokens(responses.numel(), vocab, logits_budget_bytes) if vocab else None
    if head is not None and chunk is not None:
        with (
            _head_as_log_probs(
                model, head, targets, temperature, with_entropy, chunk, predict_from, own
            ),
            _images_in_prompt(model, batch),
            replay,
        ):
            scored = model(**inputs, use_cache=False, logits_to_keep=keep).logits
        result = split_scored(_scored_log_probs(scored, targets))
        if with_entropy:
            result["entropy"] = scored[..., -1]
        return _with_router_losses(result | own.outputs(), losses)
    with _images_in_prompt(model, batch), replay:
        out = model(**inputs, use_cache=False, logits_to_keep=keep)
    logits = _response_positions(out.logits, predict_from)
    log_probs, entropy = token_log_probs(logits, targets, temperature, with_entropy)
    own.from_logits(logits, temperature)
    result = split_scored(log_probs) | own.outputs()
    if entropy is not None:
        result["entropy"] = entropy
    return _with_router_losses(result, losses)


MOE_AUX_LOSS = "moe_aux_loss"
MOE_Z_LOSS = "moe_z_loss"
"""Output keys of an MoE model's training forward: the load-balancing and router z losses
(scalars with their graph; :class:`hf_fsdp.moe_routing.RouterLosses`)."""


def _real_tokens(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[tokens]`` bool: the forward's real tokens in the routers' order (the inputs
    flattened); sequence-packed inputs (no 2-D mask) are real tokens only."""
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return mask.reshape(-1).bool()
    return torch.ones(inputs["input_ids"].numel(), dtype=torch.bool)


def _then(
    first: AbstractContextManager[None], second: RouterLosses | None
) -> AbstractContextManager[None]:
    """``first``, then ``second`` entered inside it (its router hooks run after replay's)."""
    if second is None:
        return first

    @contextmanager
    def both() -> Iterator[None]:
        with first, second:
            yield

    return both()


def _with_router_losses(
    result: dict[str, torch.Tensor], losses: RouterLosses | None
) -> dict[str, torch.Tensor]:
    if losses is not None:
        result[MOE_AUX_LOSS], result[MOE_Z_LOSS] = losses.losses()
    return result


@dataclass
class ForwardTokens:
    """Tokens the forwards computed against the plain rows' tokens (packing's saving), and
    how many of the computed ones were padding; reported as metrics."""

    computed: int = 0
    rows: int = 0
    padding: int = 0
    routing: RoutingStats = field(default_factory=RoutingStats)
    """Replayed MoE routing: agreement with the rollout's experts, expert load."""

    def add(self, inputs: dict[str, torch.Tensor], batch: Batch, padding: int) -> None:
        self.computed += int(inputs["input_ids"].numel())
        self.rows += int(batch["input_ids"].numel())
        self.padding += padding

    @property
    def fraction(self) -> float:
        return self.computed / self.rows if self.rows else 1.0


def _inputs_and_positions(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    shared_prefix: bool,
    tokens: ForwardTokens | None = None,
    sequence_packing: bool = True,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, int]:
    """Model inputs, the packed rows' response index (``None``: plain rows), and how many
    last positions the head must keep (0: all, for the packed rows' index).  Shared-prefix
    packing first (it also saves the repeated prompts), else sequence packing."""
    packed = packed_inputs(model, batch, device) if shared_prefix else None
    if packed is None and sequence_packing:
        packed = sequence_packed_inputs(model, batch, device)
    if packed is not None:
        inputs, predict_from, padding = packed
        if tokens is not None:
            tokens.add(inputs, batch, padding)
        return inputs, predict_from, 0
    inputs = _model_inputs(model, batch, device)
    if tokens is not None:
        mask = batch["attention_mask"]
        tokens.add(inputs, batch, int(mask.numel() - mask.sum()))
    return inputs, None, response_length(batch) + 1


def value_forward(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    shared_prefix: bool = True,
    tokens: ForwardTokens | None = None,
    sequence_packing: bool = True,
) -> dict[str, torch.Tensor]:
    length = response_length(batch)
    inputs, predict_from, _ = _inputs_and_positions(
        model, batch, device, shared_prefix, tokens, sequence_packing
    )
    with _images_in_prompt(model, batch):
        values = model(**inputs, use_cache=False).logits.squeeze(-1).float()
    if predict_from is None:
        return {"values": values[:, -length - 1 : -1]}
    return {"values": values.reshape(-1)[predict_from]}


@contextmanager
def _capture_output(module: nn.Module) -> Iterator[list[torch.Tensor]]:
    captured: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        yield captured
    finally:
        handle.remove()


class _Anchored(torch.autograd.Function):
    """``value`` as it is, with a forward output of the model as a second input that gets a
    zero gradient (see :func:`_through_outputs`)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        shape, dtype, device = ctx.anchor
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _through_outputs(value: torch.Tensor, outputs: Any) -> torch.Tensor:
    """``value`` (a tensor captured inside the model's forward) tied to the model's output
    ``logits``, so a backward from ``value`` also reaches that output.  FSDP2 registers its
    pre-backward hooks on a module's forward outputs; a loss on a captured intermediate
    bypasses them, and with the whole model as one FSDP unit (the default below 100M
    parameters) the root's gradients were then never reduced over the ranks (two ranks'
    score-head update came out sqrt(2) off; replicas hid it until FSDP2 became the CPU
    default).  The output gets a zero gradient: nothing changes but the hooks running."""
    anchor = getattr(outputs, "logits", None)
    if anchor is None or not (torch.is_grad_enabled() and anchor.requires_grad):
        return value
    return _Anchored.apply(value, anchor)  # type: ignore[no-any-return]


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of the mask."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


def score_forward(model: nn.Module, batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    inputs = _model_inputs(model, batch, device)
    head = getattr(model, "score", None)
    if head is None:
        raise AttributeError(f"{type(model).__name__} has no 'score' head module")
    # transformers scores the last token that is not pad_token_id; we score the attention
    # mask's last token instead (a pad id equal to eos would otherwise pick the wrong token).
    with _capture_output(head) as captured:
        outputs = model(**inputs, use_cache=False)
    per_token = _through_outputs(captured[-1], outputs).squeeze(-1).float()
    index = last_token_index(inputs["attention_mask"])
    return {"scores": per_token[torch.arange(per_token.shape[0], device=device), index]}


def sequence_parallel_forward(
    head: HeadKind,
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    group: torch.distributed.ProcessGroup,
    temperature: float = 1.0,
    with_entropy: bool = True,
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
    sequence_packing: bool = True,
    tokens: ForwardTokens | None = None,
    top_k: int = 0,
) -> dict[str, torch.Tensor]:
    """The head's outputs for one micro-batch with its tokens split over ``group``
    (:mod:`hf_fsdp.ulysses`): this rank runs its columns, the outputs are gathered, and every
    rank of the group returns the whole micro-batch's outputs (with autograd).

    An MoE policy replays the batch's ``routed_experts`` on its own columns
    (:func:`routing_replay`) and, in a training forward (``tokens``), returns the router
    losses of the whole micro-batch (:class:`~hf_fsdp.moe_routing.RouterLosses` over the
    group), as :func:`lm_forward` does on one rank."""
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    width = response_length(batch) if head != "score" else 0
    shards = ulysses.lay_out(
        batch["input_ids"],
        batch["attention_mask"],
        position_ids_of(batch),
        width,
        size,
        packed=sequence_packing,
    )
    if tokens is not None:
        tokens.add({"input_ids": shards.input_ids}, batch, shards.padding)
    inputs = {
        key: shards.local(value, rank, size).to(device)
        for key, value in (("input_ids", shards.input_ids), ("position_ids", shards.position_ids))
    }
    ulysses.set_segments(model, group, shards.segments)
    if head == "lm":
        # replay: this rank's columns of the recorded experts (a training step's outer
        # context, held through the backward, lays them out the same way); router losses
        # of a training forward over the group's real tokens
        replay = routing_replay(model, batch, tokens, group, sequence_packing)
        losses = None
        if tokens is not None and moe_routers(model):
            mask = batch["attention_mask"]
            real = ulysses.lay_out_like(mask.bool(), mask, size, sequence_packing, False)
            losses = RouterLosses(model, shards.local(real, rank, size), group)
        laid = _laid_out_targets(batch, shards, size, sequence_packing)
        targets = shards.local(laid, rank, size).to(device)
        own = TopK(top_k)
        with _then(replay, losses):
            scored = _token_scores(
                model, inputs, targets, temperature, with_entropy, logits_budget_bytes, own
            )
        index = shards.predict_from.to(device)

        def response_positions(local: torch.Tensor) -> torch.Tensor:
            gathered = ulysses.gather_columns(local, group)
            return gathered.reshape(-1, *gathered.shape[2:])[index]

        picked = response_positions(scored)
        result = split_scored(_scored_log_probs(picked, targets))
        if with_entropy:
            result["entropy"] = picked[..., -1]
        if own.ids is not None and own.log_probs is not None:
            own.ids = response_positions(own.ids)
            own.log_probs = response_positions(own.log_probs)
        return _with_router_losses(result | own.outputs(), losses)
    if head == "value":
        values = model(**inputs, use_cache=False).logits.squeeze(-1).float()
        whole = ulysses.gather_columns(values, group).reshape(-1)
        return {"values": whole[shards.predict_from.to(device)]}
    score = getattr(model, "score", None)
    if score is None:
        raise AttributeError(f"{type(model).__name__} has no 'score' head module")
    with _capture_output(score) as captured:
        outputs = model(**inputs, use_cache=False)
    local = _through_outputs(captured[-1], outputs).squeeze(-1).float()
    per_token = ulysses.gather_columns(local, group).reshape(-1)
    return {"scores": per_token[shards.last_token.to(device)]}


def _laid_out_targets(
    batch: Batch, shards: ulysses.SequenceShards, size: int, packed: bool
) -> torch.Tensor:
    """``[rows, L]`` targets of the sequence-parallel layout, or ``[rows, L, 1 + k]`` with
    the batch's teacher top-k ids at the positions predicting response tokens (0 elsewhere:
    those positions are not read back)."""
    if TEACHER_TOP_K_IDS not in batch:
        return shards.targets
    ids = batch[TEACHER_TOP_K_IDS].long()
    mask = batch["attention_mask"]
    rows, columns = mask.shape
    width = ids.shape[1]
    per_column = ids.new_zeros(rows, columns, ids.shape[2])
    per_column[:, columns - width - 1 : columns - 1] = ids  # column c predicts c + 1
    laid = ulysses.lay_out_like(per_column, mask, size, packed, 0)
    return torch.cat([shards.targets.unsqueeze(-1), laid], dim=-1)


def _token_scores(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    logits_budget_bytes: int,
    own: TopK,
) -> torch.Tensor:
    """``[rows, n, m + 1]``: the log-probs of each position's ``m`` target ids (``m`` = 1
    for ``[rows, n]`` targets), then its entropy; the chunked head where it applies (no
    ``[n, vocab]`` logits kept).  ``own`` receives the positions' own top-k."""
    head = _chunkable_head(model)
    vocab = int(head.weight.shape[0]) if head is not None else 0
    positions = targets.shape[0] * targets.shape[1]
    chunk = logits_chunk_tokens(positions, vocab, logits_budget_bytes) if vocab else None
    if head is not None and chunk is not None:
        every = torch.arange(positions, device=targets.device).view(targets.shape[:2])
        with _head_as_log_probs(model, head, targets, temperature, with_entropy, chunk, every, own):
            scored: torch.Tensor = model(**inputs, use_cache=False).logits
        return scored
    logits = model(**inputs, use_cache=False).logits
    log_probs, entropy = token_log_probs(logits, targets, temperature, with_entropy)
    own.from_logits(logits, temperature)
    if targets.dim() == 2:
        log_probs = log_probs.unsqueeze(-1)
    last = log_probs[..., :1] if entropy is None else entropy.unsqueeze(-1)
    return torch.cat([log_probs, last], dim=-1)


def forward(
    head: HeadKind,
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    temperature: float = 1.0,
    with_entropy: bool = True,
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
    shared_prefix: bool = True,
    tokens: ForwardTokens | None = None,
    sequence_packing: bool = True,
    top_k: int = 0,
) -> dict[str, torch.Tensor]:
    """The head kind's outputs for one micro-batch (with autograd if enabled);
    ``shared_prefix``: pack rows that repeat a prompt where that pays (:func:`packed_inputs`);
    ``sequence_packing``: else the samples back to back without padding, where that pays
    (:func:`sequence_packed_inputs`); ``tokens`` counts what the forward computed."""
    if head == "lm":
        return lm_forward(
            model,
            batch,
            device,
            temperature,
            with_entropy,
            logits_budget_bytes,
            shared_prefix,
            tokens,
            sequence_packing,
            top_k,
        )
    if head == "value":
        return value_forward(model, batch, device, shared_prefix, tokens, sequence_packing)
    return score_forward(model, batch, device)
