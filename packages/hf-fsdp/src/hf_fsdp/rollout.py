"""The transformers rollout engine: batched sampling with a KV cache, weights synced in place.

It needs nothing beyond transformers, so it is the rollout backend that always works (and the
reference other backends are checked against).  Each rank holds a whole, unsharded copy of the
model and decodes its own prompts (generation DP = training DP).

Decoding is a small loop over a KV-cached decode session (hf_fsdp.decoder: the lean
Llama-family decoder where it applies, transformers' forward otherwise) rather than
``model.generate``: it samples with its own ``torch.Generator`` (so rollouts do not disturb
the training RNG), and it returns the log-prob of every sampled token under
``softmax(logits / temperature)`` (raw logits when greedy), the quantity the training engine
recomputes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hf_core.batch import Batch
from hf_core.device import (
    release_cached_memory,
    resolve_device,
    warn_if_emulated_half,
)
from hf_core.engines import (
    NamedTensor,
    ResponseSteps,
    RolloutEngine,
    SamplingParams,
    assemble_rollout,
    check_model_folder,
    expand_prompts,
    select_tokens,
    special_tokens,
)
from hf_core.engines.dtypes import rollout_dtype
from hf_core.engines.model_classes import causal_lm_class, checkpoint_names
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, pad_columns
from hf_core.engines.streaming import ChunkedStream, TokenStream
from hf_core.multimodal import MULTI_MODAL_KEY, ImageFeatures, has_images
from hf_core.renamed import HF_MEANS_HYBRIDFLOW, renamed_attributes
from hf_fsdp.config import TransformersRolloutConfig, parse_config
from hf_fsdp.cpu_leader_rollout import LeaderGeneration
from hf_fsdp.decoder import (
    DecodeSession,
    LlamaFamilyDecoder,
    TransformersSession,
    VisionLanguageSession,
    lean_decoder_unsupported,
)
from hf_fsdp.export import persistent_buffers
from hf_fsdp.fused_experts import expert_names, expert_slices
from hf_fsdp.moe_routing import RoutingRecorder, moe_routers
from hf_fsdp.offload import model_bytes
from hf_fsdp.onednn_linear import linear as onednn_linear
from hf_fsdp.onednn_linear import use_onednn_linear
from hf_fsdp.stream_decoder import LeanTokenStream

log = logging.getLogger(__name__)


@torch.no_grad()
def _own_storage(model: torch.nn.Module) -> None:
    """Copy CPU tensors that still alias the memory-mapped safetensors file into private memory.

    Otherwise the first weight sync pages the whole model in (a surprise RSS step), and a
    model file rewritten in place later would corrupt (or SIGBUS) the live engine.
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()


class _ThisRank:
    """An engine's generation of this rank's prompts alone, never on the leader: what a chunked
    token stream calls (each rank's stream advances on its own schedule)."""

    def __init__(self, engine: TransformersRolloutEngine) -> None:
        self.engine = engine
        self.pad_token_id = engine.pad_token_id
        self.eos_token_ids = engine.eos_token_ids

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.engine.generate_here(prompts, params)


class TransformersRolloutEngine(RolloutEngine):
    """A causal LM per rank (a vision-language one included), decoding left-padded prompts in
    batches."""

    def __init__(self, config: TransformersRolloutConfig | dict[str, Any]) -> None:
        from transformers import AutoConfig

        self.config = cfg = parse_config(TransformersRolloutConfig, config)
        folder = check_model_folder(cfg.model_path)
        self.device = resolve_device(cfg.device)
        self.compute_dtype = rollout_dtype(cfg.dtype, folder, self.device)
        kwargs: dict[str, Any] = {"dtype": self.compute_dtype}
        warn_if_emulated_half(self.device, self.compute_dtype, "the transformers rollout engine")
        if cfg.attn_implementation:
            kwargs["attn_implementation"] = cfg.attn_implementation
        auto_class = causal_lm_class(AutoConfig.from_pretrained(folder))
        self.model = auto_class.from_pretrained(folder, **kwargs).to(self.device)
        self.model.eval().requires_grad_(False)
        onednn = self.device.type == "cpu" and cfg.cpu_linear == "onednn"
        if onednn:
            use_onednn_linear(self.model)
        _own_storage(self.model)
        self._moe = bool(moe_routers(self.model))
        """A mixture of experts: generations can return each token's experts (routing replay)."""
        self._lean = self._lean_decoder(onednn)
        self._targets: dict[str, torch.Tensor] = {}
        self._index_targets()

        tokens = special_tokens(folder, self.model.config)
        self.eos_token_ids, self.pad_token_id = list(tokens.eos_token_ids), tokens.pad_token_id
        self._generator = torch.Generator(self.device).manual_seed(cfg.seed)
        self.weight_version = 0
        self._tensors_this_sync = 0
        self._released = False
        self._model_bytes: int | None = None
        self._leader: LeaderGeneration | None = None
        """Set with ``cpu_leader_generation``: CPU ranks of one host decode on its first rank."""
        if cfg.cpu_leader_generation:
            self._leader = LeaderGeneration.for_this_process(self.device)

    def _lean_decoder(self, onednn: bool) -> LlamaFamilyDecoder | None:
        if self.config.decoder == "transformers":
            return None
        reason = lean_decoder_unsupported(self.model)
        if reason is not None:
            log.info("decoding with transformers' forward: %s", reason)
            return None
        return LlamaFamilyDecoder(self.model, onednn_linear if onednn else F.linear)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, bucket: Iterable[NamedTensor]) -> None:
        """Copy canonical tensors into the model's parameters in place (any subset)."""
        for name, tensor in bucket:
            target = self._targets.get(name)
            if target is None:
                raise KeyError(
                    f"rollout model {type(self.model).__name__} has no parameter {name!r}"
                )
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: got shape {tuple(tensor.shape)}, rollout model has "
                    f"{tuple(target.shape)}"
                )
            target.copy_(tensor)
            self._tensors_this_sync += 1

    def finish_weight_sync(self) -> None:
        log.debug("weight sync %d: %d tensors", self.weight_version + 1, self._tensors_this_sync)
        self.weight_version += 1
        self._tensors_this_sync = 0

    def _index_targets(self) -> None:
        """Name -> tensor that :meth:`load_weights` copies into.  Parameters keep their
        identity through ``model.to``; buffers are replaced, so this runs again after a move."""
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(persistent_buffers(self.model))
        saved = checkpoint_names(self.model, targets)  # canonical names are the checkpoint's
        self._targets = {saved[name]: tensor for name, tensor in targets.items()}
        if self._moe:  # the checkpoint's per-expert tensors are views of the fused ones
            names = expert_names(self.model.config.model_type)
            for name, tensor in targets.items():
                for expert, view in expert_slices(name, tensor.data, names) or []:
                    self._targets.pop(saved[name], None)
                    self._targets[expert] = view

    def _move(self, device: torch.device) -> int:
        """Move the model (on a CPU-only engine: nothing) and say what that moves: weights
        and buffers.  No KV cache is held between generations (each decode builds its own)."""
        if self._model_bytes is None:  # shapes never change: count once
            self._model_bytes = model_bytes(self.model, grads=False)
        moved = self._model_bytes
        if self.device.type != "cpu":
            self.model.to(device)
            if self._lean is not None:
                self._lean.refresh()  # the move gave each fused view its own storage
            self._index_targets()
        return moved

    def release_memory(self) -> int:
        """Park the weights in host memory while training runs; the bytes moved.  On a
        CPU-only engine nothing moves and the bytes a GPU run would move are returned; a
        second call returns 0.  The next generation resumes by itself."""
        if self._released:
            return 0
        moved = self._move(torch.device("cpu"))
        release_cached_memory(self.device)
        self._released = True
        return moved

    def resume_memory(self) -> int:
        """Undo :meth:`release_memory`; the bytes moved back (0 when not released)."""
        if not self._released:
            return 0
        moved = self._move(self.device)
        self._released = False
        return moved

    # --------------------------------------------------------------- generation
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample ``params.n`` responses per prompt (consecutive rows), right-padded to
        ``max_new_tokens`` so batches from different ranks concatenate.  With
        ``cpu_leader_generation`` CPU ranks on one host hand their prompts to its first rank
        (:mod:`hf_fsdp.cpu_leader_rollout`): every rank must then call this together."""
        if self._leader is not None:
            return self._leader.generate(prompts, lambda whole: self.generate_here(whole, params))
        return self.generate_here(prompts, params)

    def open_stream(self, capacity: int, chunk_tokens: int) -> TokenStream:
        """Streaming rollouts: continuous batching on the lean decoder
        (:mod:`hf_fsdp.stream_decoder`, the KV cache kept between weight updates and
        recomputed after one); with transformers' forward, chunks of ``chunk_tokens``
        through this rank's own generation.  Streams never go to the leader: each rank's advances on
        its own schedule.

        A mixture-of-experts model always streams in chunks (the lean decoder is dense-only):
        with ``SamplingParams.routed_experts`` each chunk's generation records the experts of
        every token it feeds (:class:`RoutingRecorder`, the prefix prefilled again at every
        chunk, so after a weight update too), and each request keeps the experts of the first
        forward that fed a position
        (:meth:`~hf_core.engines.streaming.StreamRequest.record_routing`)."""
        if self._released:
            self.resume_memory()
        if self._lean is None:
            return ChunkedStream(_ThisRank(self), chunk_tokens)
        stops = list(self.eos_token_ids)
        return LeanTokenStream(
            self._lean, capacity, stops, self.pad_token_id, self._generator, self.device
        )

    def generate_here(self, prompts: Batch, params: SamplingParams) -> Batch:
        """:meth:`generate` of this rank's ``prompts`` in this process (never on the leader)."""
        batch = expand_prompts(prompts, params)
        if self._released:
            self.resume_memory()
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        stops = sorted({*params.stop_token_ids, *self.eos_token_ids})
        # pieces hold whole groups of a prompt's n samples, so each is prefilled once
        size = self.config.max_batch_size
        size = size // params.n * params.n or size
        pieces = [
            self._decode(
                piece["input_ids"],
                piece["attention_mask"],
                params,
                generator,
                stops,
                list(piece[MULTI_MODAL_KEY]) if has_images(piece) else None,
            )
            for piece in batch.split(size)
        ]
        responses, log_probs, response_mask = (
            torch.cat([piece[i] for piece in pieces]) for i in range(3)
        )
        out = assemble_rollout(batch, responses, response_mask, log_probs, params.temperature)
        if pieces and pieces[0][3] is not None:
            out[ROUTED_EXPERTS_KEY] = torch.cat([piece[3] for piece in pieces])
        return out

    def _session(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        group: int,
        features: list[ImageFeatures] | None = None,
    ) -> DecodeSession:
        if features is not None:
            return VisionLanguageSession(
                self.model, input_ids, attention_mask, max_new_tokens, features
            )
        if self._lean is not None:
            return self._lean.open(input_ids, attention_mask, max_new_tokens, group)
        return TransformersSession(self.model, input_ids, attention_mask, max_new_tokens)

    @torch.no_grad()
    def _decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
        stops: list[int],
        features: list[ImageFeatures] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Responses, their log-probs and mask, and with ``params.routed_experts`` on an MoE
        model each fed token's experts (``[rows, prompt + max_new_tokens, layers, k]``;
        the last sampled token is never fed, so it has none).  ``features``: the rows' images
        (a vision-language model's prompts)."""
        ids = input_ids.to(self.device)
        rows, prompt_len = ids.shape
        new_tokens = params.max_new_tokens
        mask = attention_mask.to(self.device)
        session = self._session(ids, mask, new_tokens, params.n, features)
        recorder = RoutingRecorder(self.model) if params.routed_experts and self._moe else None
        routed: list[torch.Tensor] = []
        with recorder if recorder is not None else nullcontext():
            logits = session.prefill()
            if recorder is not None:
                routed.append(recorder.take(rows, prompt_len))
            steps = ResponseSteps(rows, stops, self.pad_token_id, self.device)
            # On an accelerator "all rows stopped?" is a host sync: ask every few steps only.
            check_every = 1 if self.device.type == "cpu" else 8
            for step in range(new_tokens):
                tokens, _ = steps.add(*select_tokens(logits, params, generator))
                if step == new_tokens - 1 or (step % check_every == 0 and steps.done):
                    break
                logits = session.step(tokens)
                if recorder is not None:
                    routed.append(recorder.take(rows, 1))
        responses, log_probs, response_mask = steps.tensors(new_tokens)
        experts = pad_columns(torch.cat(routed, 1), prompt_len + new_tokens) if routed else None
        return responses.cpu(), log_probs.cpu(), response_mask.cpu(), experts


if not TYPE_CHECKING:  # type checkers keep flagging unknown names
    __getattr__ = renamed_attributes(
        __name__, {"HFRolloutEngine": "TransformersRolloutEngine"}, HF_MEANS_HYBRIDFLOW
    )
