"""The FSDP2 training engine: one class for actor, critic, reference, reward and cost models.

``head`` picks the model (causal LM, per-token value, per-sequence score); ``trainable=False``
makes a frozen model without optimiser.  All methods are SPMD: every rank of the group calls
them together (they run collectives), each with its own slice of the batch.

Loss scaling contract (see :meth:`FSDPEngine.train_step`): FSDP *averages* gradients over
the ``dp_size`` ranks, and micro-batch gradients are *summed*.  Each micro-batch's ``meta``
carries the counts a loss needs to scale itself so that the averaged gradient equals the
gradient of the loss over the global batch (:mod:`hf_core.engines.loss_totals`, computed as
every backend does), e.g. a sample mean over the global batch is
``per_sample.sum() * dp_size / global_batch_size`` and a token mean is
``(per_token * mask).sum() * dp_size / global_response_tokens``.

Under sequence parallelism (``sequence_parallel_size``, :mod:`hf_fsdp.ulysses`) the ranks of
a group hold the same batch and ``dp_size`` counts the groups (the data chunks), not the
ranks; the same formulas then hold.

How the ranks hold the model and combine their work is the engine's data-parallel strategy
(:mod:`hf_fsdp.data_parallel`: FSDP2 shards, or on CPU ranks of one host replicas or one
model on the host's leader), chosen once when the engine is built; nothing below asks which
one runs.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hf_core.batch import Batch
from hf_core.device import (
    collective_device,
    ensure_process_group,
    release_cached_memory,
    resolve_device,
    warn_if_emulated_half,
)
from hf_core.engines import (
    LoRAConfig,
    LossFn,
    MicroBatch,
    NamedTensor,
    TrainingEngine,
    check_model_folder,
    combine_metric_rows,
    is_adapter_name,
    iter_buckets,
    restore_outputs,
    save_hf_folder,
    split_micro_batches,
    write_peft_folder,
)
from hf_core.engines.memory_fit import DEFAULT_MAX_TOKENS, MicroBatchFit
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY
from hf_core.engines.shared_prefix import prompt_groups
from hf_core.engines.top_k import TOP_K_IDS, TOP_K_LOG_PROBS
from hf_core.protocols import WorkerMesh
from hf_fsdp import checkpoint, fit, heads, lora, ulysses
from hf_fsdp.config import FSDPEngineConfig, parse_config, to_dtype
from hf_fsdp.data_parallel.base import DataParallel, Peers, Share, UpdateResult
from hf_fsdp.data_parallel.build import build as build_data_parallel
from hf_fsdp.distributed import data_parallel_mesh
from hf_fsdp.export import FSDPWeightMapping, canonical_names, stream_canonical
from hf_fsdp.loading import (
    HEAD_MODULES,
    build_empty_model,
    load_hf_config,
    materialize_and_load,
    set_gradient_checkpointing,
)
from hf_fsdp.moe_routing import check_routing, moe_routers
from hf_fsdp.offload import DryMoveCounter, move_model, move_optimizer
from hf_fsdp.onednn_linear import use_onednn_linear
from hf_fsdp.optim import build_optimizer, build_scheduler, clip_grad_norm

if TYPE_CHECKING:
    from hf_core.resharding import RankPlan

log = logging.getLogger(__name__)

ADAPTER_FOLDER = "adapter"
"""A LoRA engine's checkpoint holds its adapters in peft format in this sub-folder too."""


def _longest(batch: Batch) -> int:
    """The longest sample's tokens (1 for an empty batch): what the micro-batch fit needs."""
    return int(batch["attention_mask"].sum(-1).max()) if len(batch) else 1


class FSDPEngine(TrainingEngine):
    """A HuggingFace model over all ranks of the default process group, held as its
    data-parallel strategy says (:attr:`data_parallel`; FSDP2 shards by default)."""

    def __init__(self, config: FSDPEngineConfig | dict[str, Any]) -> None:
        self.config = cfg = parse_config(FSDPEngineConfig, config)
        self.folder = check_model_folder(cfg.model_path)
        self.device = resolve_device(cfg.device)
        ensure_process_group(self.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        self.mesh = data_parallel_mesh(self.device)
        self.sp_size = cfg.sequence_parallel_size
        self.sp_group = ulysses.sequence_parallel_group(self.sp_size)
        """The ranks splitting this rank's sequences (:mod:`hf_fsdp.ulysses`); None: SP = 1."""

        self.hf_config = load_hf_config(cfg, self.folder)
        model = build_empty_model(cfg, self.hf_config)
        if self.sp_group is not None:
            ulysses.enable(model, self.sp_size)
        self.architecture = type(model).__name__  # fully_shard swaps in an FSDP subclass
        if cfg.lora is not None:
            lora.inject_lora(model, cfg.lora, HEAD_MODULES[cfg.head])
        names = canonical_names(model)  # before sharding: see FSDPWeightMapping
        host_shards = cfg.cpu_offload and self.device.type == "cuda"
        self.data_parallel: DataParallel = build_data_parallel(cfg, self.device, model, self.mesh)
        """How the ranks hold the model and combine their work (:mod:`hf_fsdp.data_parallel`)."""
        self.data_parallel.prepare(model)
        self.load_report = materialize_and_load(
            model,
            self.folder,
            cfg.head,
            self.device,
            cfg.seed,
            names,
            shard_device=torch.device("cpu") if host_shards else None,
        )
        if self.device.type == "cpu" and cfg.cpu_linear == "onednn":
            use_onednn_linear(model)
        if not cfg.trainable:
            model.requires_grad_(False)
        self.data_parallel.loaded(model)
        warn_if_emulated_half(self.device, fit.compute_dtype(cfg, self.device), "the FSDP engine")
        self.model = model
        self.mapping = FSDPWeightMapping(model, names)
        self.param_shapes = {
            self.mapping.to_hf[n]: list(p.shape) for n, p in model.named_parameters()
        }
        self._adapted = lora.adapted_weights(list(self.param_shapes))
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        if cfg.trainable and self.data_parallel.holds_optimizer:
            self.optimizer = build_optimizer(model.parameters(), cfg)
            self.scheduler = build_scheduler(self.optimizer, cfg)
        self.step = 0
        self._collective_device = collective_device()
        self._offloaded = False
        self._said_cpu_offload = False
        self._dry_counts = DryMoveCounter(self.model, self.optimizer)
        self.fit: MicroBatchFit | None = None
        self._checkpointing = cfg.gradient_checkpointing is True
        """The ``auto`` micro-batch budget and checkpointing, chosen at the first update."""

    # ------------------------------------------------------------------ helpers
    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes.values())

    def worker_mesh(self) -> WorkerMesh:
        """Data chunks go to the sequence-parallel groups: the ranks of one group share a
        chunk (:class:`~hf_core.engines.HasWorkerMesh`); generation stays one chunk a rank."""
        sp = self.sp_size
        if sp == 1:
            return WorkerMesh(self.rank, self.world_size)
        return WorkerMesh(
            dp_rank=self.rank // sp,
            dp_size=self.world_size // sp,
            sp_rank=self.rank % sp,
            sp_size=sp,
            gen_dp_rank=self.rank,
            gen_dp_size=self.world_size,
        )

    def _require(self, head: str, what: str) -> None:
        if self.config.head != head:
            raise NotImplementedError(
                f"{what} needs head={head!r}; this engine was built with head={self.config.head!r}"
            )

    def _require_onloaded(self, what: str) -> None:
        if self._offloaded:
            raise RuntimeError(f"{what}: the engine is offloaded; call onload() first")

    def data_parallel_strategy(self) -> str:
        """The data-parallel strategy this engine runs (``fsdp2``, ``cpu_replicas``,
        ``cpu_leader``; :mod:`hf_fsdp.data_parallel`), also in every update's metrics
        as ``data_parallel/<name>``."""
        return self.data_parallel.name

    def _token_budget(self, training: bool) -> int | None:
        """``max_tokens_per_micro_batch``, with ``auto`` resolved: for an update, what the
        process's memory affords (:mod:`hf_fsdp.fit`, decided once, at the first update, with
        gradient checkpointing); for forward-only passes (no activations kept), the default."""
        tokens = self.config.max_tokens_per_micro_batch
        if tokens != "auto":
            return tokens
        return self.fit.max_tokens if training and self.fit is not None else DEFAULT_MAX_TOKENS

    def _choose_fit(self, longest: int, peers: Peers) -> None:
        """The ``auto`` micro-batch budget and checkpointing, at the first update: the state
        divided as the strategy divides it, the node's memory shared by the processes that
        grow while they update."""
        # a sequence-parallel rank holds its share of each sample's tokens
        longest = -(-peers.agree(longest, dist.ReduceOp.MAX) // self.sp_size)
        strategy = self.data_parallel
        self.fit = fit.resolve_fit(
            self.config,
            self.hf_config,
            self.model,
            strategy.state_ranks,
            self.rank,
            longest,
            growing_processes=strategy.growing_processes,
        )
        # ranks must agree: each measured its own memory
        tokens = peers.agree(self.fit.max_tokens, dist.ReduceOp.MIN)
        without = peers.agree(self.fit.tokens_without_checkpointing, dist.ReduceOp.MIN)
        recompute = peers.agree(int(self.fit.gradient_checkpointing), dist.ReduceOp.MAX)
        self.fit = dataclasses.replace(
            self.fit,
            max_tokens=tokens,
            gradient_checkpointing=bool(recompute),
            tokens_without_checkpointing=without,
        )

    def _recompute_for(self, micro: list[MicroBatch], peers: Peers) -> None:
        """``gradient_checkpointing: auto``: recompute in this update only when its largest
        micro-batch (on any rank) holds more tokens than fit without it; the numbers are the
        same either way, only memory and time differ."""
        if self.config.gradient_checkpointing != "auto" or self.fit is None:
            return
        if not self.fit.gradient_checkpointing:  # never needed: no collective per update
            return
        largest = max((int(m.batch["attention_mask"].numel()) for m in micro), default=0)
        largest = -(-peers.agree(largest, dist.ReduceOp.MAX) // self.sp_size)  # this rank's
        on = self.fit.gradient_checkpointing and largest > self.fit.tokens_without_checkpointing
        if on != self._checkpointing:
            set_gradient_checkpointing(self.model, on)
            self._checkpointing = on

    def _plan(self, batch: Batch, training: bool = False) -> list[MicroBatch]:
        """``batch``'s micro-batches (length-grouped, padding trimmed; see
        :mod:`hf_core.engines.micro_batches`)."""
        cfg = self.config
        if ROUTED_EXPERTS_KEY in batch:  # ids that fit the model, before any forward
            check_routing(moe_routers(self.model), batch[ROUTED_EXPERTS_KEY])
        groups = None
        if cfg.shared_prefix and "responses" in batch and len(batch):
            groups = prompt_groups(
                batch["input_ids"], batch["attention_mask"], int(batch["responses"].shape[1])
            )
        budget = self._token_budget(training)
        if budget is not None:  # a budget is per rank: a sequence-parallel group splits tokens
            budget *= self.sp_size
        return split_micro_batches(batch, budget, cfg.micro_batch_size, groups)

    def _passes(self, micro: list[MicroBatch], peers: Peers) -> int:
        """How many forward passes this process runs over ``micro``: the largest count of any
        rank computing beside it.  Ranks with fewer micro-batches run extra passes on a copy
        of their first one and drop the result: FSDP's collectives need every rank in every
        pass."""
        count = peers.agree(len(micro), dist.ReduceOp.MAX)
        if count and not micro:
            raise ValueError(
                f"rank {self.rank} got an empty batch while other ranks have data; "
                "split batches evenly over the data-parallel ranks"
            )
        return count

    @torch.no_grad()
    def _forward_only(self, batch: Batch, keys: tuple[str, ...], **kwargs: Any) -> Batch:
        def forward(batches: list[Batch], peers: Peers) -> list[Batch]:
            return [self._forward_micro_batches(b, keys, peers, **kwargs) for b in batches]

        return self.data_parallel.forward(batch, forward)

    def _forward_micro_batches(
        self, batch: Batch, keys: tuple[str, ...], peers: Peers, **kwargs: Any
    ) -> Batch:
        micro = self._plan(batch)
        count = self._passes(micro, peers)
        self.model.eval()
        outputs: list[dict[str, torch.Tensor]] = []
        for i in range(count):
            part = micro[min(i, len(micro) - 1)].batch
            out = self._head_forward(part, **kwargs)
            if i < len(micro):
                outputs.append({k: out[k].detach().cpu() for k in keys})
        self.data_parallel.release(self.model)
        if not outputs:
            return Batch(batch_size=0)
        width = int(batch["responses"].shape[1]) if "responses" in batch else 0
        mask = batch["response_mask"] if "response_mask" in batch else None
        return Batch(restore_outputs(outputs, micro, len(batch), width, mask))

    def _head_forward(
        self,
        batch: Batch,
        temperature: float = 1.0,
        tokens: heads.ForwardTokens | None = None,
        top_k: int = 0,
    ) -> dict[str, torch.Tensor]:
        """One micro-batch through the head (:mod:`hf_fsdp.heads`), its tokens split over
        the sequence-parallel group when there is one."""
        cfg = self.config
        if self.sp_group is not None:
            return heads.sequence_parallel_forward(
                cfg.head,
                self.model,
                batch,
                self.device,
                self.sp_group,
                temperature,
                logits_budget_bytes=cfg.logits_budget_bytes,
                sequence_packing=cfg.sequence_packing,
                tokens=tokens,
                top_k=top_k,
            )
        return heads.forward(
            cfg.head,
            self.model,
            batch,
            self.device,
            temperature,
            logits_budget_bytes=cfg.logits_budget_bytes,
            shared_prefix=cfg.shared_prefix,
            sequence_packing=cfg.sequence_packing,
            tokens=tokens,
            top_k=top_k,
        )

    # ---------------------------------------------------------------- forwards
    def compute_log_probs(self, batch: Batch, temperature: float = 1.0, top_k: int = 0) -> Batch:
        """``log_probs`` and ``entropy`` of ``responses``, shape ``[B, response_len]``; with
        ``top_k`` also the model's own top-k ids and log-probs per response position,
        ``[B, response_len, top_k]`` (:mod:`hf_core.engines.top_k`)."""
        self._require("lm", "compute_log_probs")
        self._require_onloaded("compute_log_probs")
        keys = ("log_probs", "entropy", *((TOP_K_IDS, TOP_K_LOG_PROBS) if top_k else ()))
        return self._forward_only(batch, keys, temperature=temperature, top_k=top_k)

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` per response token, shape ``[B, response_len]``."""
        self._require("value", "compute_values")
        self._require_onloaded("compute_values")
        return self._forward_only(batch, ("values",))

    def compute_scores(self, batch: Batch) -> Batch:
        """``scores`` per sequence, shape ``[B]``."""
        self._require("score", "compute_scores")
        self._require_onloaded("compute_scores")
        return self._forward_only(batch, ("scores",))

    # -------------------------------------------------------------- train step
    @staticmethod
    def _response_tokens(batch: Batch) -> int:
        return int(batch["response_mask"].sum()) if "response_mask" in batch else 0

    def _loss_meta(
        self,
        batch: Batch,
        num_micro: int,
        rank: int,
        totals: dict[str, Any],
        dp_size: int,
    ) -> dict[str, Any]:
        """``totals``: :func:`~hf_core.engines.loss_totals.loss_totals` of the mini-batch."""
        return {
            **totals,
            "dp_size": dp_size,
            "dp_rank": rank,
            "mini_batch_size": len(batch),
            "num_micro_batches": num_micro,
            "local_response_tokens": self._response_tokens(batch),
        }

    @property
    def compute_dtype(self) -> torch.dtype:
        """bfloat16 under ``mixed_precision: auto`` on a GPU, else the configured dtype."""
        return fit.compute_dtype(self.config, self.device)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimiser step over this rank's ``batch``, in micro-batches.

        ``loss_fn(outputs, micro_batch)`` gets the head's outputs (with autograd) and returns
        the loss to back-propagate, already scaled as described in the module docstring
        using ``micro_batch.meta``: ``dp_size``, ``mini_batch_size`` (this rank),
        ``num_micro_batches``, ``micro_batch_size``, ``local_response_tokens`` (the sum of
        ``response_mask`` when the batch has one) and the global counts of
        :func:`~hf_core.engines.loss_totals.loss_totals` (``global_batch_size``,
        ``global_response_tokens``, ``global_nonempty_rows``, ``global_response_length``,
        ``global_group_tokens`` when the batch has ``group_index``).
        The actor's log-probs use ``batch.meta["temperature"]`` (default 1.0).  Under leader
        training the host's first rank calls ``loss_fn`` for every rank's micro-batches, so
        it must depend only on its arguments and on settings every rank shares.

        Returns the loss function's metrics and ``loss`` combined over micro-batches and
        ranks (:func:`~hf_core.engines.combine_metric_rows`: means, maxima for ``*_max``),
        plus ``grad_norm`` (before clipping, global), ``lr`` (used by this step), ``step``,
        ``update_skipped`` (1.0 when the gradient norm was not finite) and
        ``data_parallel/<strategy>`` (1.0: which strategy ran, :meth:`data_parallel_strategy`).
        """
        if not self.config.trainable:
            raise RuntimeError(
                "train_step on a frozen engine (trainable=False: reference / reward model)"
            )
        self._require_onloaded("train_step")
        metrics_out, self.fit, self._checkpointing = self.data_parallel.train(
            batch, lambda shares, peers: self._update(shares, peers, loss_fn)
        )
        self.step += 1
        metrics_out["step"] = float(self.step)
        metrics_out[f"data_parallel/{self.data_parallel.name}"] = 1.0
        if self.fit is not None:  # the choice only: its memory figures are logged once
            metrics_out.update(
                {
                    "fit/micro_batch_tokens": float(self.fit.max_tokens),
                    "fit/gradient_checkpointing": float(self._checkpointing),
                }
            )
        return metrics_out

    def _optimizer_step(self, metrics: dict[str, float], across_ranks: bool) -> dict[str, float]:
        """Clip, step and clear the gradients (``across_ranks``: the norm is reduced over
        the ranks, as each holds gradients); ``metrics`` with the step's own added."""
        assert self.optimizer is not None and self.scheduler is not None
        grad_norm = clip_grad_norm(
            self.model.parameters(),
            self.config.grad_clip,
            self._collective_device,
            across_ranks=across_ranks,
        )
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("step %d: gradient norm %s, update skipped", self.step, grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {
            **metrics,
            "grad_norm": grad_norm,
            "lr": float(lr),
            "update_skipped": float(skipped),
        }

    def _update(self, shares: list[Share], peers: Peers, loss_fn: LossFn) -> UpdateResult:
        """Gradients of ``shares`` (the ranks' batches this process computes: its own, or
        under leader training every rank's), averaged over the ranks, then the optimizer
        step; the metrics, and the fit and checkpointing the update ran with."""
        cfg = self.config
        if self.fit is None and "auto" in (
            cfg.max_tokens_per_micro_batch,
            cfg.gradient_checkpointing,
        ):
            self._choose_fit(max(_longest(share.batch) for share in shares), peers)
        plans = [self._plan(share.batch, training=True) for share in shares]
        self._recompute_for([m for plan in plans for m in plan], peers)
        totals = peers.loss_totals([share.batch for share in shares])
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        tokens = heads.ForwardTokens()
        rows = []
        for share, micro in zip(shares, plans, strict=True):
            meta = self._loss_meta(share.batch, len(micro), share.dp_rank, totals, share.dp_size)
            count = self._passes(micro, peers)
            passes = self._backward(share.batch, micro, count, meta, loss_fn, tokens, len(shares))
            # each micro-batch's loss is its share of the global loss: they add up on a rank
            rows.append(combine_metric_rows(passes, sums=("loss",)))
        self.data_parallel.reduce_gradients([p for p in self.model.parameters() if p.requires_grad])
        local = combine_metric_rows(rows)
        if tokens.rows:  # below 1 where packing saved repeated prompts or padding
            local["forward_token_fraction"] = tokens.fraction
            local["padding_tokens_sum"] = float(tokens.padding)
        local.update(tokens.routing.metrics())  # MoE models under routing replay
        metrics = self._optimizer_step(peers.metrics(local), peers.across_ranks)
        return metrics, self.fit, self._checkpointing

    def _backward(
        self,
        batch: Batch,
        micro: list[MicroBatch],
        count: int,
        meta: dict[str, Any],
        loss_fn: LossFn,
        tokens: heads.ForwardTokens,
        ranks_summed: int = 1,
    ) -> list[dict[str, float]]:
        """Forward and backward over ``count`` passes of ``micro`` (extra passes repeat the
        first and add nothing: FSDP's collectives need every rank in every pass); each real
        micro-batch's metrics.  ``ranks_summed``: how many ranks' batches this process
        computes one after another (leader training of batches that cannot be joined), whose
        gradients add up here: each loss is scaled down to keep the average."""
        temperature = float(batch.meta.get("temperature", 1.0))
        self.model.train()
        rows: list[dict[str, float]] = []
        for i in range(count):
            real = i < len(micro)
            mb = micro[i].batch if real else micro[0].batch
            if self.device.type != "cpu":  # the loss reads its inputs beside the outputs
                mb = mb.to(self.device)
            mb.meta.update(meta, micro_batch_index=i, micro_batch_size=len(mb))
            counted = tokens if real else None
            # an MoE batch's recorded experts stay in force through the backward, where
            # activation checkpointing recomputes the forward
            lm = self.config.head == "lm"
            # (under sequence parallelism this rank's columns of them, laid out as its forward
            # lays out the tokens)
            replay = (
                heads.routing_replay(
                    self.model, mb, counted, self.sp_group, self.config.sequence_packing
                )
                if lm
                else nullcontext()
            )
            with replay:
                outputs = self._head_forward(mb, temperature, tokens=counted)
                loss, metrics = loss_fn(outputs, mb)
                if real:
                    loss = self._with_router_losses(loss, outputs, metrics, meta, loss_fn)
                    rows.append({**metrics, "loss": float(loss.detach())})
                else:
                    loss = loss * 0.0  # keeps this rank in FSDP's collectives, adds nothing
                if ranks_summed != 1:
                    loss = loss / ranks_summed
                loss.backward()
        return rows

    def _with_router_losses(
        self,
        loss: torch.Tensor,
        outputs: dict[str, torch.Tensor],
        metrics: dict[str, float],
        meta: dict[str, Any],
        loss_fn: LossFn,
    ) -> torch.Tensor:
        """An MoE model's load-balancing and z losses (a training forward's
        ``heads.MOE_AUX_LOSS`` / ``MOE_Z_LOSS``) added to the actor's ``loss`` with
        ``algorithm.moe_aux_loss_coef`` / ``moe_z_loss_coef`` (read off the actor's policy
        loss, which carries the algorithm config; 0 for any other loss), each micro-batch's
        value / the rank's micro-batches (the ranks then average); both reported in
        ``metrics`` (``moe/aux_loss``, ``moe/z_loss``) whatever the coefficients."""
        algo = getattr(loss_fn, "algo", None)
        coefs = {
            heads.MOE_AUX_LOSS: float(getattr(algo, "moe_aux_loss_coef", 0.0) or 0.0),
            heads.MOE_Z_LOSS: float(getattr(algo, "moe_z_loss_coef", 0.0) or 0.0),
        }
        if heads.MOE_AUX_LOSS not in outputs:
            if self.config.head == "lm" and any(coefs.values()) and moe_routers(self.model):
                raise RuntimeError(
                    "algorithm.moe_aux_loss_coef / moe_z_loss_coef: the training forward of "
                    f"this MoE model returned no router losses ({heads.MOE_AUX_LOSS}); set "
                    "them to 0"
                )
            return loss
        share = 1.0 / max(int(meta.get("num_micro_batches", 1)), 1)
        for key, name in ((heads.MOE_AUX_LOSS, "aux_loss"), (heads.MOE_Z_LOSS, "z_loss")):
            value = outputs[key]
            metrics[f"moe/{name}"] = float(value.detach())
            if coefs[key] > 0:
                loss = loss + coefs[key] * share * value.to(loss.dtype)
        return loss

    # ------------------------------------------------------------ weight export
    def export_weights(
        self, bucket_bytes: int, plan: RankPlan | None = None
    ) -> Iterator[list[NamedTensor]]:
        """Full canonical tensors in buckets of ``bucket_bytes``; every rank must consume
        the whole iterator (each tensor is an all-gather).

        FSDP's training layout is pure data parallel (p = t = 1), so the only plan that fits
        it is "every rank holds the whole model", the same as ``plan=None``.
        """
        if plan is not None and plan.num_units != 1:
            raise NotImplementedError(
                f"the FSDP engine's layout is pure DP (p=t=1); a reshard plan over "
                f"{plan.num_units} units belongs to a TP/PP backend"
            )
        self._require_onloaded("export_weights")
        return iter_buckets(self._merged(self._gathered(bucket_bytes)), bucket_bytes)

    def _readable(self) -> None:
        """Before the ranks read the weights: nothing left gathered by a forward, every
        rank's copy current (:meth:`DataParallel.release`, :meth:`DataParallel.publish`)."""
        self.data_parallel.release(self.model)
        self.data_parallel.publish()

    def _gathered(
        self, bucket_bytes: int, only: Callable[[str], bool] | None = None
    ) -> Iterator[NamedTensor]:
        """Full canonical tensors (those ``only`` keeps), gathered from the shards in the
        export dtype.  A gather holds the ranks' pieces and the full tensors built from them:
        half a bucket each keeps a sync's extra memory at about one bucket."""
        self._readable()
        dtype = to_dtype(self.config.export_dtype) if self.config.export_dtype else None
        return stream_canonical(
            self.model,
            self.mapping,
            device=self.device,
            dtype=dtype,
            bucket_bytes=bucket_bytes // 2,
            only=only,
        )

    def _merged(self, stream: Iterator[NamedTensor]) -> Iterator[NamedTensor]:
        """With LoRA, the adapters folded into their weights (what a plain model computes)."""
        if self.config.lora is None:
            return stream
        return lora.merged(stream, self.config.lora.scaling, self._adapted)

    # ------------------------------------------------------------------ adapters
    def lora_config(self) -> LoRAConfig | None:
        """The LoRA settings this engine trains with; ``None``: full fine-tuning."""
        return self.config.lora

    def _require_lora(self, what: str) -> LoRAConfig:
        if self.config.lora is None:
            raise NotImplementedError(f"{what}: this engine trains without LoRA adapters")
        return self.config.lora

    def adapters_disabled(self) -> AbstractContextManager[None]:
        """Forwards inside compute the base model (the frozen weights alone)."""
        if self.config.lora is None:
            return nullcontext()
        return lora.adapters_disabled(self.model)

    def export_adapters(self, bucket_bytes: int) -> Iterator[list[NamedTensor]]:
        """Only the LoRA adapters, full tensors under canonical adapter names, in buckets;
        every rank consumes the whole iterator (each bucket is an all-gather)."""
        self._require_lora("export_adapters")
        self._require_onloaded("export_adapters")
        return iter_buckets(self._gathered(bucket_bytes, only=is_adapter_name), bucket_bytes)

    def export_adapter_folder(self, path: Path) -> Path:
        """Write the adapters as a peft folder (every rank calls; rank 0 writes)."""
        config = self._require_lora("export_adapter_folder")
        tensors = [item for bucket in self.export_adapters(64 * 2**20) for item in bucket]
        if self.rank == 0:
            write_peft_folder(path, config, tensors, base_model=self.folder)
        if dist.is_initialized():
            dist.barrier()
        return Path(path)

    def export_hf(
        self,
        path: str | Path,
        tokenizer: str | Path | None = None,
        shard_bytes: int = 2 * 1024**3,
    ) -> Path:
        """Write the model as a HuggingFace folder (``from_pretrained`` loads it).

        Every rank calls this; rank 0 writes.  ``tokenizer`` (a tokenizer folder; default
        ``config.tokenizer_path``) is saved alongside.
        """
        self._require_onloaded("export_hf")
        self._readable()
        hf_config = copy.deepcopy(self.hf_config)
        hf_config.dtype = self.config.param_dtype
        stream = self._merged(stream_canonical(self.model, self.mapping, device=self.device))
        return save_hf_folder(
            stream,
            path,
            hf_config,
            self.architecture,
            shard_bytes=shard_bytes,
            tokenizer=tokenizer if tokenizer is not None else self.config.tokenizer_path,
            source_folder=self.folder,
        )

    # -------------------------------------------------------------- checkpoints
    def _checkpoint_info(self) -> dict[str, Any]:
        return {"head": self.config.head, "architecture": self.architecture}

    def save_checkpoint(self, path: str | Path) -> None:
        self._require_onloaded("save_checkpoint")
        self._readable()
        checkpoint.save(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            step=self.step,
            param_shapes=self.param_shapes,
            info=self._checkpoint_info(),
            record=fit.record(self.fit),
        )
        if self.config.lora is not None:  # the adapters also as peft loads them
            self.export_adapter_folder(Path(path) / ADAPTER_FOLDER)

    def load_checkpoint(self, path: str | Path) -> None:
        self._require_onloaded("load_checkpoint")
        self.data_parallel.release(self.model)
        self.step = checkpoint.load(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            param_shapes=self.param_shapes,
            info=self._checkpoint_info(),
        )
        # the resumed run splits batches as the saved one did (bit-exact resume)
        self.fit = fit.restored(checkpoint.read_manifest(path)[1], self.fit)

    # ------------------------------------------------------------------ offload
    def _cpu_only(self) -> bool:
        if self.device.type != "cpu":
            return False
        if not self._said_cpu_offload:
            log.info("offload/onload: the engine runs on the CPU, nothing to move")
            self._said_cpu_offload = True
        return True

    def _hand_over(self, device: torch.device) -> int:
        """Move what the config names (parameters with their gradients, unless FSDP already
        keeps them on the host; optimiser state) to ``device``; bytes moved.  On a CPU-only
        engine nothing moves: the bytes a GPU run would move are counted instead."""
        dry = self._cpu_only()
        moved = 0
        if self.config.offload_params and not self.config.cpu_offload:
            moved += self._dry_counts.model() if dry else move_model(self.model, device)
        if self.config.offload_optimizer and self.optimizer is not None:
            moved += self._dry_counts.optimizer() if dry else move_optimizer(self.optimizer, device)
        if not dry:
            release_cached_memory(self.device)
        return moved

    def offload(self) -> int:
        """Move parameters, gradients and optimiser state (this rank's shards) to host memory;
        the bytes moved (CPU-only: would move).  The engine refuses work until :meth:`onload`,
        on the CPU too, so a misordered hand-over fails there as it would on a GPU.  A second
        call moves nothing and returns 0."""
        if self._offloaded:
            return 0
        # count and move the shards, not a root left gathered by a forward
        self.data_parallel.release(self.model)
        moved = self._hand_over(torch.device("cpu"))
        self._offloaded = True
        return moved

    def onload(self) -> int:
        """Undo :meth:`offload`; the bytes moved back (0 when not offloaded)."""
        if not self._offloaded:
            return 0
        moved = self._hand_over(self.device)
        self._offloaded = False
        return moved

    @property
    def offloaded(self) -> bool:
        return self._offloaded
