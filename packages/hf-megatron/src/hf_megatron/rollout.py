"""A rollout engine on megatron-core with its own tensor-parallel group (generation TP).

In the 3D-HybridEngine, generation may keep tensor parallelism (``t_g > 1``).  This engine
is the CPU stand-in for such a backend (vLLM is the product path on GPU): a megatron GPT
model built over the *generation* TP group of a reshard plan (``pg_collection``), so it
loads the TP slices the training engine's reshard yields with no further communication.

Decoding recomputes the whole sequence every step (no KV cache): fine for tests and small
models, not for production.  All ranks of a generation TP group call :meth:`generate` with
the same prompts (core's ``3D_ALL_MICRO_DP`` protocol does that); the tokens chosen on TP
rank 0 are broadcast so the group never diverges.  Only ``p_g = 1`` is supported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from hf_core.batch import Batch
from hf_core.device import ensure_process_group, resolve_device
from hf_core.engines import (
    CanonicalSlice,
    GenerationRank,
    NamedTensor,
    RolloutEngine,
    SamplingParams,
    select_tokens,
)
from hf_core.engines.decoding import ResponseSteps, expand_prompts
from hf_core.engines.hf_folder import check_model_folder, special_tokens
from hf_core.engines.model_classes import refuse_vision_model
from hf_core.engines.rollout import assemble_rollout
from hf_core.resharding import GenerationLayout, ReshardPlan
from hf_megatron import _cpu_compat as cpu_compat
from hf_megatron import forward
from hf_megatron.config import MegatronRolloutConfig, parse_config, to_dtype
from hf_megatron.loading import FolderReader, load_hf_config
from hf_megatron.model import build_gpt, layer_spec, mark_tensor_parallel, transformer_config
from hf_megatron.weight_mapping import (
    MegatronWeightMapping,
    ModelDims,
    RankPosition,
)

log = logging.getLogger(__name__)

_GROUPS: dict[tuple[tuple[int, ...], ...], dict[tuple[int, ...], dist.ProcessGroup]] = {}


def _groups(groups: list[tuple[int, ...]]) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """``new_group`` for each group, on every rank in the same order (once per set)."""
    key = tuple(groups)
    if key not in _GROUPS:
        _GROUPS[key] = {g: dist.new_group(list(g)) for g in groups}
    return _GROUPS[key]


def _blocks(world: int, cfg: MegatronRolloutConfig) -> list[tuple[int, ...]]:
    """Generation TP groups of the layout the trainer resolved (``tensor_parallel_size``
    consecutive ranks, as vLLM forms them): core's grouping, not a second one here."""
    try:
        return GenerationLayout(pp=1, tp=cfg.tensor_parallel_size).engine_ranks(world)
    except ValueError as exc:
        raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size}: {exc}") from None


class MegatronRolloutEngine(RolloutEngine):
    """Greedy / sampled decoding with a megatron GPT model split over a generation TP group."""

    def __init__(
        self, config: MegatronRolloutConfig | dict[str, Any], plan: ReshardPlan | None = None
    ) -> None:
        self.config = cfg = parse_config(MegatronRolloutConfig, config)
        folder = check_model_folder(cfg.model_path)
        refuse_vision_model(
            folder,
            "megatron rollout",
            "its weight mapping covers text decoders only; use rollout.backend=transformers",
        )
        self.device = resolve_device(cfg.device)
        ensure_process_group(self.device)
        rank, world = dist.get_rank(), dist.get_world_size()
        if plan is not None and plan.gen.pp != 1:
            raise NotImplementedError("the megatron rollout engine supports generation pp = 1")
        tp_groups = list(plan.gen_tp_groups) if plan is not None else _blocks(world, cfg)
        self.tp_ranks = next(g for g in tp_groups if rank in g)
        self.tp_rank, self.tp_size = self.tp_ranks.index(rank), len(self.tp_ranks)
        self.replica, self.replicas = sorted(tp_groups).index(self.tp_ranks), len(tp_groups)
        self.tp_group = _groups(tp_groups)[self.tp_ranks]
        single = _groups([(r,) for r in range(world)])[(rank,)]
        self.hf_config = load_hf_config(folder)
        self.dims = ModelDims.from_hf(self.hf_config, "lm")
        self.padded_vocab = cfg.padded_vocab_size or self.dims.padded_vocab(
            self.tp_size, cfg.make_vocab_size_divisible_by
        )
        self.mapping = MegatronWeightMapping(
            self.dims, RankPosition(self.tp_rank, self.tp_size), self.padded_vocab
        )
        with cpu_compat.cpu_device_mode():
            self.model = self._build(single)
            self._load_folder(folder)
        self._params = dict(self.model.named_parameters())
        self._consumers = {
            name: [p for p in self.mapping.params if name in {x.hf_name for x in p.parts}]
            for name in self.dims.canonical_shapes()
        }
        self._pending: dict[str, CanonicalSlice] = {}
        self._released = False
        self._built_this_sync = 0
        self.weight_version = 0
        tokens = special_tokens(folder, self.hf_config)
        self.eos_token_ids, self.pad_token_id = list(tokens.eos_token_ids), tokens.pad_token_id
        self._generator = torch.Generator().manual_seed(cfg.seed)

    # ------------------------------------------------------------------ building
    def _build(self, single: dist.ProcessGroup) -> Any:
        from megatron.core.process_groups_config import ProcessGroupCollection

        on_gpu = self.device.type == "cuda"
        dtype = to_dtype(self.config.dtype)
        tconfig = transformer_config(
            self.hf_config, self.dims, tp=self.tp_size, pp=1, dtype=dtype, on_gpu=on_gpu
        )
        pgs = ProcessGroupCollection(tp=self.tp_group, pp=single, cp=single, embd=None)
        model = build_gpt(
            self.hf_config,
            self.dims,
            tconfig,
            layer_spec("local"),
            padded_vocab=self.padded_vocab,
            pre_process=True,
            post_process=True,
            pg_collection=pgs,
        )
        if on_gpu:
            model.cuda(self.device)
        mark_tensor_parallel(model, self.mapping.params)
        model.eval().requires_grad_(False)
        self.dtype = dtype
        return model

    @torch.no_grad()
    def _load_folder(self, folder: Any) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in self.mapping.load(FolderReader(folder), self.dtype):
            params[name].copy_(tensor)

    def generation_rank(self) -> GenerationRank:
        """This rank's generation replica and TP rank, so ``3D_ALL_MICRO_DP`` gives every
        rank of one TP group the same prompts."""
        return GenerationRank(
            dp_rank=self.replica,
            dp_size=self.replicas,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )

    def generation_layout(self) -> GenerationLayout:
        """The generation layout ``(p_g = 1, t_g)`` this engine's TP group was built for: it
        loads generation TP slices itself (:class:`~hf_core.engines.LoadsTPSlices`)."""
        return GenerationLayout(pp=1, tp=self.tp_size)

    # ------------------------------------------------------------------- weights
    def _fetch(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        piece = self._pending[name]
        if dim is None:
            return piece.tensor
        if piece.dim is None:
            return piece.tensor.narrow(dim, start, stop - start)
        if piece.dim != dim or not piece.start <= start <= stop <= piece.stop:
            raise ValueError(
                f"{name}: got rows [{piece.start}, {piece.stop}) on dim {piece.dim}; TP rank "
                f"{self.tp_rank}/{self.tp_size} needs [{start}, {stop}) on dim {dim} "
                "(generation TP size or vocabulary padding differ from the sender's)"
            )
        return piece.tensor.narrow(dim, start - piece.start, stop - start)

    @torch.no_grad()
    def load_weights(self, bucket: Iterable[NamedTensor | CanonicalSlice]) -> None:
        """Load whole canonical tensors or this rank's TP slices (:class:`CanonicalSlice`);
        q/k/v (and gate/up) may arrive in different buckets."""
        for item in bucket:
            piece = item if isinstance(item, CanonicalSlice) else self._whole(*item)
            if piece.name not in self._consumers:
                raise KeyError(f"rollout model has no canonical tensor {piece.name!r}")
            self._pending[piece.name] = piece
            for param in self._consumers[piece.name]:
                needs = {p.hf_name for p in param.parts}
                if needs <= self._pending.keys():
                    target = self._params[param.name]
                    target.copy_(param.build(self._fetch, target.dtype))
                    self._built_this_sync += 1
            for name in [n for n in self._pending if self._all_built(n)]:
                del self._pending[name]

    def _whole(self, name: str, tensor: torch.Tensor) -> CanonicalSlice:
        return CanonicalSlice(name, tensor, None, 0, tuple(tensor.shape))

    def _all_built(self, name: str) -> bool:
        """A pending tensor can go once every consumer of it had all its sources."""
        return all(
            {p.hf_name for p in param.parts} <= self._pending.keys()
            for param in self._consumers[name]
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's share of the model (its generation TP shard)."""
        return sum(p.numel() * p.element_size() for p in self._params.values())

    def release_memory(self) -> int:
        """Move the weights to host memory while training runs (GPU); on the CPU nothing moves
        and the bytes that would are reported.  There is no KV cache to free."""
        if self._released:
            return 0
        self._released = True
        if self.device.type == "cuda":
            self.model.to("cpu")
        return self.weight_bytes

    def resume_memory(self) -> int:
        """Undo :meth:`release_memory` before a weight sync or generation."""
        if not self._released:
            return 0
        self._released = False
        if self.device.type == "cuda":
            self.model.to(self.device)
        return self.weight_bytes

    def finish_weight_sync(self) -> None:
        if self._pending:
            raise RuntimeError(
                f"weight sync ended with incomplete fused tensors: {sorted(self._pending)[:4]}"
            )
        log.debug("weight sync %d: %d tensors", self.weight_version + 1, self._built_this_sync)
        self.weight_version += 1
        self._built_this_sync = 0

    # ---------------------------------------------------------------- generation
    @cpu_compat.on_cpu
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample ``params.n`` responses per prompt (consecutive rows), right-padded to
        ``max_new_tokens``; same output keys as every rollout engine."""
        batch = expand_prompts(prompts, params)
        self.resume_memory()
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        stops = sorted({*params.stop_token_ids, *self.eos_token_ids})
        pieces = [
            self._decode(p, params, generator, stops)
            for p in batch.split(self.config.max_batch_size)
        ]
        responses, log_probs, response_mask = (torch.cat(x) for x in zip(*pieces, strict=True))
        return assemble_rollout(batch, responses, response_mask, log_probs, params.temperature)

    def _next_logits(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[B, V]`` at each row's last real token."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        width = int(lengths.max())
        positions = torch.arange(width)[None, :].expand(ids.shape[0], width)
        local = self.model(ids[:, :width].to(self.device), positions.to(self.device), None)
        rows = torch.arange(ids.shape[0], device=local.device)
        last = local[rows, (lengths - 1).to(local.device)]
        if self.tp_size > 1:
            last = gather_from_tensor_model_parallel_region(last, group=self.tp_group)
        return last[:, : self.dims.vocab_size].float()

    @torch.no_grad()
    def _decode(
        self, prompts: Batch, params: SamplingParams, generator: torch.Generator, stops: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Responses, log-probs and mask of one chunk of prompts (all ranks of the TP group
        decode the same chunk and take TP rank 0's choice of token)."""
        ids, _, lengths = forward.pack_left(
            prompts["input_ids"], prompts["attention_mask"], self.pad_token_id
        )
        rows = ids.shape[0]
        ids = torch.cat([ids, torch.full((rows, params.max_new_tokens), self.pad_token_id)], 1)
        lengths = lengths.clone()
        steps = ResponseSteps(rows, stops, self.pad_token_id)
        for _ in range(params.max_new_tokens):
            logits = self._next_logits(ids, lengths).cpu()
            tokens, log_probs = select_tokens(logits, params, generator)
            if self.tp_size > 1:  # one decision for the whole TP group
                both = torch.stack([tokens.double(), log_probs.double()]).to(self.device)
                dist.broadcast(both, src=self.tp_ranks[0], group=self.tp_group)
                tokens, log_probs = both[0].long().cpu(), both[1].float().cpu()
            tokens, alive = steps.add(tokens, log_probs)
            ids[torch.arange(rows), lengths] = tokens
            lengths = lengths + alive.long()
            if steps.done:
                break
        return steps.tensors(params.max_new_tokens)
