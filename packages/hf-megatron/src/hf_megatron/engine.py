"""The megatron-core training engine: actor, critic, reference (and reward) with TP/PP/DP.

One class serves every role: ``head`` picks the model (causal LM, per-token value,
per-sequence score), ``trainable=False`` makes a frozen model without optimiser.  All
methods are SPMD over the engine's process group (the default one): every rank calls them
together, and every rank of a DP replica (its TP x PP ranks) gets the *same* batch -- what
core's ``3D_PROTO`` dispatches.  Outputs are computed on the last pipeline stage (the
protocol collects TP rank 0 of it) and broadcast to the other stages of the pipeline, so every
rank returns the same batch (code written for a pure-DP engine keeps working).

Loss-scaling contract: identical to hf-fsdp's engine, so core's trainer drives either.
Gradients are *averaged* over the ``dp_size`` data-parallel replicas and micro-batch
gradients are *summed*.  ``micro_batch.meta`` carries ``dp_size``, ``dp_rank``,
``mini_batch_size``, ``num_micro_batches``, ``micro_batch_index``, ``micro_batch_size``,
``local_response_tokens`` and the global counts of :mod:`hf_core.engines.loss_totals`
(``global_batch_size``, ``global_response_tokens``, ``global_nonempty_rows``, ...: counts over
DP replicas, not over TP/PP ranks, which see copies of the same data); e.g. a token mean over
the global batch is ``(per_token * mask).sum() * dp_size / global_response_tokens``.
megatron's pipeline schedules divide each micro-batch loss by the number of micro-batches;
the engine multiplies it back, so the loss function's value is what is back-propagated.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_core.batch import Batch
from hf_core.device import (
    collective_device,
    ensure_process_group,
    resolve_device,
    warn_if_emulated_half,
)
from hf_core.engines import (
    LossFn,
    NamedTensor,
    TrainingEngine,
    check_model_folder,
    combine_metric_rows,
    save_hf_folder,
)
from hf_core.engines.loss_totals import all_reduce_over, loss_totals
from hf_core.engines.model_classes import refuse_vision_model
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, check_routed_experts
from hf_core.engines.top_k import TOP_K_IDS, TOP_K_LOG_PROBS
from hf_core.protocols import WorkerMesh
from hf_core.resharding import (
    GenerationLayout,
    ParallelLayout,
    RankPlan,
    ReshardPlan,
    ReshardReport,
    build_hybrid_plan,
    build_naive_plan,
)
from hf_megatron import _cpu_compat as cpu_compat
from hf_megatron import checkpoint, forward, moe_routing
from hf_megatron.config import MegatronEngineConfig, parse_config, to_dtype
from hf_megatron.loading import FolderReader, architecture_for, load_hf_config
from hf_megatron.model import (
    build_gpt,
    layer_spec,
    mark_tensor_parallel,
    resolve_layer_spec,
    transformer_config,
)
from hf_megatron.parallel import (
    MegatronLayout,
    current_generation,
    ensure_model_parallel,
    worker_mesh,
)
from hf_megatron.reshard import ExpertGather, Resharder, ReshardStats, resolve_plan
from hf_megatron.weight_mapping import (
    CanonicalSlice,
    MegatronWeightMapping,
    ModelDims,
    RankPosition,
)

log = logging.getLogger(__name__)

OUTPUT_KEYS = {"lm": ("log_probs", "entropy"), "value": ("values",), "score": ("scores",)}


class MegatronEngine(TrainingEngine):
    """A HF Llama / Qwen2 model as a megatron-core GPT model over TP x PP x DP ranks."""

    def __init__(self, config: MegatronEngineConfig | dict[str, Any]) -> None:
        self.config = cfg = parse_config(MegatronEngineConfig, config)
        self.folder = check_model_folder(cfg.model_path)
        refuse_vision_model(
            self.folder,
            "megatron training",
            "its weight mapping covers text decoders only; use backend fsdp",
        )
        self.device = resolve_device(cfg.device)
        self.on_gpu = self.device.type == "cuda"
        ensure_process_group(self.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        with cpu_compat.cpu_device_mode():
            self._build()
        self.step = 0
        self.reshard_stats: ReshardStats | None = None
        """What the last :meth:`export_slices` moved on this rank (tests, bench)."""
        self._offloaded = False

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        cfg = self.config
        self.layout: MegatronLayout = ensure_model_parallel(
            cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.seed, cfg.expert_parallel_size
        )
        torch.manual_seed(cfg.seed)
        self.hf_config = load_hf_config(self.folder)
        self.spec_kind = resolve_layer_spec(cfg.layer_spec, self.on_gpu)
        if cfg.sequence_parallel and self.spec_kind != "transformer_engine":
            raise ValueError("sequence_parallel needs the Transformer Engine spec (GPU)")
        self.dims = ModelDims.from_hf(
            self.hf_config, cfg.head, fused_norms=self.spec_kind == "transformer_engine"
        )
        tp, pp = self.layout.tp, self.layout.pp
        self.padded_vocab = self.dims.padded_vocab(tp, cfg.make_vocab_size_divisible_by)
        c = self.layout.coords
        ep = self.layout.ep
        if ep > 1 and not self.dims.is_moe:
            raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model")
        self.position = RankPosition(c.tp, tp, c.pp, pp, self.layout.ep_rank, ep)
        self.mapping = MegatronWeightMapping(self.dims, self.position, self.padded_vocab)
        self.dtype = to_dtype(cfg.param_dtype)
        warn_if_emulated_half(self.device, self.dtype, "the megatron engine")
        self.tconfig = transformer_config(
            self.hf_config,
            self.dims,
            tp=tp,
            pp=pp,
            dtype=self.dtype,
            on_gpu=self.on_gpu,
            sequence_parallel=cfg.sequence_parallel,
            ep=ep,
        )
        module = build_gpt(
            self.hf_config,
            self.dims,
            self.tconfig,
            layer_spec(self.spec_kind, self.dims),
            padded_vocab=self.padded_vocab,
            pre_process=self.position.first_stage,
            post_process=self.position.last_stage,
        )
        if self.on_gpu:
            module.cuda(self.device)
        _params_in(module, self.dtype)
        self.module = module
        self._check_parameters()
        mark_tensor_parallel(module, self.mapping.params)
        reader = FolderReader(
            self.folder,
            seed=cfg.seed,
            init_std=float(getattr(self.hf_config, "initializer_range", 0.02)),
            hidden_size=self.dims.hidden_size,
        )
        self._load_native(reader)
        self.initialized_heads = list(reader.initialized)
        self.optimizer: Any = None
        if cfg.trainable:
            self._wrap_for_training()
            self.model: Any = self._ddp
        else:
            module.requires_grad_(False)
            self.model = module
        self._layout_generation = current_generation()

    def _check_parameters(self) -> None:
        got = {n: tuple(p.shape) for n, p in self.module.named_parameters()}
        want = self.mapping.native_shapes()
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))[:6]
            raise RuntimeError(f"megatron model and weight mapping disagree: {diff}")

    @torch.no_grad()
    def _load_native(self, fetch: Callable[..., torch.Tensor]) -> None:
        params = dict(self.module.named_parameters())
        for name, tensor in self.mapping.load(fetch, self.dtype):
            params[name].copy_(tensor.to(params[name].device))

    def _wrap_for_training(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        self._ddp = DistributedDataParallel(
            config=self.tconfig, ddp_config=ddp_config, module=self.module
        )
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.lr * cfg.min_lr_ratio,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            adam_eps=cfg.eps,
            clip_grad=cfg.grad_clip or 0.0,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16,
        )
        # None: megatron's own rule for which parameters get weight decay
        overrides: dict[Any, Any] | None = {} if cfg.weight_decay_scope == "all" else None
        self.optimizer = get_megatron_optimizer(opt_config, [self._ddp], config_overrides=overrides)
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.no_sync_func = self._ddp.no_sync
        if self.dtype == torch.float16:
            self.tconfig.grad_scale_func = self.optimizer.scale_loss

    # ------------------------------------------------------------------ helpers
    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.dims.canonical_shapes().values())

    @property
    def is_output_rank(self) -> bool:
        """Last pipeline stage: where outputs and losses exist."""
        return self.position.last_stage

    def parallel_layout(self) -> ParallelLayout:
        """The training mesh ``(p, t, d)`` in megatron's rank order (what plans map from)."""
        return self.layout.layout

    def last_reshard(self) -> ReshardReport | None:
        """The last transition as core reports it (``None`` before the first)."""
        return self.reshard_stats.report() if self.reshard_stats is not None else None

    def reshard_plan(self, gen_tp: int = 1, gen_pp: int = 1, kind: str = "hybrid") -> ReshardPlan:
        """Core's plan from this engine's training layout to generation ``(gen_pp, gen_tp)``;
        ``kind`` is ``hybrid`` (the paper's) or ``naive`` (HybridFlow-V)."""
        if kind not in ("hybrid", "naive"):
            raise ValueError(f"reshard kind must be 'hybrid' or 'naive', got {kind!r}")
        build = build_hybrid_plan if kind == "hybrid" else build_naive_plan
        return build(self.layout.layout, GenerationLayout(pp=gen_pp, tp=gen_tp))

    def worker_mesh(self, plan: ReshardPlan | None = None) -> WorkerMesh:
        """What a worker reports with ``Worker.set_mesh`` (with the generation mesh of
        ``plan`` if given), so 3D_PROTO / 3D_ALL_MICRO_DP route data correctly."""
        return worker_mesh(self.layout, plan)

    def _require(self, head: str, what: str) -> None:
        if self.config.head != head:
            raise NotImplementedError(
                f"{what} needs head={head!r}; this engine was built with head={self.config.head!r}"
            )

    def _require_ready(self, what: str) -> None:
        if self._offloaded:
            raise RuntimeError(f"{what}: the engine is offloaded; call onload() first")
        if self._layout_generation != current_generation():
            raise RuntimeError(
                f"{what}: megatron's process groups were re-initialised for another layout "
                "after this engine was built (one layout per process)"
            )

    def _dp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def _tp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group()

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        if len(batch) == 0:
            raise ValueError(
                f"rank {self.rank} got an empty batch; split batches over the DP replicas "
                "so that each gets at least one sample"
            )
        if ROUTED_EXPERTS_KEY in batch and self.dims.is_moe:  # ids that fit the model
            layers = self.dims.num_layers
            check_routed_experts(
                batch[ROUTED_EXPERTS_KEY],
                [self.dims.num_experts] * layers,
                [self.dims.moe_topk] * layers,
            )
        return batch.split(self.config.micro_batch_size)

    def _head_outputs(
        self,
        output: torch.Tensor,
        packed: forward.PackedInputs,
        temperature: float,
        top_k: int = 0,
    ) -> dict[str, torch.Tensor]:
        head = self.config.head
        if head == "lm":
            tp_rank, tp = self.position.tp_rank, self.position.tp_size
            out = forward.lm_outputs(
                output,
                packed,
                vocab_start=tp_rank * (self.padded_vocab // tp),
                vocab_size=self.dims.vocab_size,
                temperature=temperature,
                group=self._tp_group(),
                top_k=top_k,
            )
        elif head == "value":
            out = forward.value_outputs(output, packed)
        else:
            out = forward.score_outputs(output, packed)
        return {k: v[: packed.rows] for k, v in out.items()}

    def _loss_func(
        self,
        batch: Batch,
        packed: forward.PackedInputs,
        loss_fn: LossFn | None,
        temperature: float,
        top_k: int,
        num_micro: int,
        output: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        outputs = self._head_outputs(output, packed, temperature, top_k)
        if loss_fn is None:
            zero = output.sum() * 0.0
            return zero, {k: _floats_stay_float32(v.detach()).cpu() for k, v in outputs.items()}
        loss, metrics = loss_fn(outputs, batch)
        reported = {"loss": float(loss.detach())}
        reported.update({k: float(v) for k, v in metrics.items()})
        # megatron divides by the number of micro-batches; undo it (module docstring).
        return loss * num_micro, reported

    def _expert_parallel_shape(self, count: int, rows: int, seq: int) -> tuple[int, int]:
        """The micro-batch rows and columns every expert-parallel rank packs to (the
        largest of the group's), after checking they run the same number of micro-batches:
        megatron's allgather dispatcher gathers equal token counts in every MoE layer."""
        from megatron.core import parallel_state as ps

        group = ps.get_expert_model_parallel_group()
        device = collective_device()
        high = torch.tensor([count, rows, seq], device=device)
        low = torch.tensor([count], device=device)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        if int(low[0]) != int(high[0]):
            raise ValueError(
                f"expert parallelism (ep={self.layout.ep}): the expert-parallel ranks got "
                f"{int(low[0])} and {int(high[0])} micro-batches; every rank must run the same "
                "number (split batches evenly over the data-parallel ranks)"
            )
        return int(high[1]), int(high[2])

    def _routing_of(
        self,
        micro: Batch,
        packed: forward.PackedInputs,
        rows_to: int | None,
        columns_to: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Routing replay's recorded ids of a micro-batch in megatron's token order, and
        which tokens are real (None without recorded ids: the router decides)."""
        if ROUTED_EXPERTS_KEY not in micro:
            return None
        if not self.dims.is_moe:
            raise ValueError(
                f"batch key {ROUTED_EXPERTS_KEY!r} (routing replay) but the model has no "
                "mixture-of-experts layers"
            )
        columns = int(packed.input_ids.shape[1])
        routed = moe_routing.packed_routing(
            micro[ROUTED_EXPERTS_KEY], packed.shift, rows_to, columns_to
        )
        lengths = packed.lengths.clone().cpu()
        lengths[packed.rows :] = 0  # rows repeated for the pipeline count nowhere
        return routed, moe_routing.real_tokens(lengths, columns)

    def _run(
        self,
        micro: list[Batch],
        *,
        loss_fn: LossFn | None,
        temperature: float,
        routing_stats: moe_routing.RoutingStats | None = None,
        top_k: int = 0,
    ) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        pp = self.layout.pp
        rows = max(len(m) for m in micro)
        seq = int(micro[0]["input_ids"].shape[1])
        columns_to, rows_to = None, rows if pp > 1 else None
        if self.layout.ep > 1:  # the token all-gather needs equal shapes on the EP ranks
            rows, seq = self._expert_parallel_shape(len(micro), rows, seq)
            columns_to, rows_to = seq, rows
        if any(int(m["input_ids"].shape[1]) != seq for m in micro):
            raise ValueError("all micro-batches of a call must have the same sequence length")
        pad_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        device = self.device
        packed = [
            forward.pack_batch(m, rows_to=rows_to, pad_id=pad_id, columns_to=columns_to).to(device)
            for m in micro
        ]
        on_device = [m.to(device) for m in micro] if device.type != "cpu" else micro
        routing = [
            self._routing_of(m, pk, rows_to, columns_to)
            for m, pk in zip(micro, packed, strict=True)
        ]
        data = iter(list(zip(on_device, packed, routing, strict=True)))

        def step(data_iterator: Iterator, model: Any) -> tuple[torch.Tensor, Callable]:
            batch, pk, routed = next(data_iterator)
            if routed is None:
                output = model(pk.input_ids, pk.position_ids, None)
            else:
                ids, real = routed
                first = self.position.pp_rank * (self.dims.num_layers // self.layout.pp)
                with moe_routing.replaying(self.module, ids, real, first, routing_stats):
                    output = model(pk.input_ids, pk.position_ids, None)
            loss = functools.partial(
                self._loss_func, batch, pk, loss_fn, temperature, top_k, len(micro)
            )
            return output, loss

        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=data,
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=rows,
            forward_only=loss_fn is None,
        )

    @torch.no_grad()
    def _forward_only(
        self, batch: Batch, keys: tuple[str, ...], temperature: float, top_k: int = 0
    ) -> Batch:
        self.model.eval()
        results = self._run(
            self._micro_batches(batch), loss_fn=None, temperature=temperature, top_k=top_k
        )
        out = {k: torch.cat([r[k] for r in results]) for k in keys} if self.is_output_rank else {}
        if self.layout.pp > 1:
            rows = (len(batch), *((batch["responses"].shape[1],) if keys != ("scores",) else ()))
            top = (*rows, top_k)
            like = {TOP_K_IDS: (top, torch.long), TOP_K_LOG_PROBS: (top, torch.float32)}
            out = self._from_last_stage(
                out, {key: like.get(key, (rows, torch.float32)) for key in keys}
            )
        return Batch(out)

    def _from_last_stage(
        self,
        out: dict[str, torch.Tensor],
        keys: dict[str, tuple[tuple[int, ...], torch.dtype]],
    ) -> dict[str, torch.Tensor]:
        """The last stage's outputs on every stage of this pipeline (one broadcast each);
        ``keys``: each output's shape and dtype."""
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        src = ps.get_pipeline_model_parallel_last_rank()
        device = collective_device()
        shared = {}
        for key, (shape, dtype) in keys.items():
            tensor = (
                out[key].to(device)
                if key in out
                else torch.empty(shape, dtype=dtype, device=device)
            )
            dist.broadcast(tensor, src=src, group=group)
            shared[key] = tensor.cpu()
        return shared

    # ---------------------------------------------------------------- forwards
    @cpu_compat.on_cpu
    def compute_log_probs(self, batch: Batch, temperature: float = 1.0, top_k: int = 0) -> Batch:
        """``log_probs`` and ``entropy`` of ``responses``, ``[B, response_len]``; with
        ``top_k`` also the model's own top-k ids and log-probs, ``[B, response_len, top_k]``
        (:mod:`hf_core.engines.top_k`)."""
        self._require("lm", "compute_log_probs")
        self._require_ready("compute_log_probs")
        keys = (*OUTPUT_KEYS["lm"], *((TOP_K_IDS, TOP_K_LOG_PROBS) if top_k else ()))
        return self._forward_only(batch, keys, temperature, top_k)

    @cpu_compat.on_cpu
    def compute_values(self, batch: Batch) -> Batch:
        """``values`` per response token, ``[B, response_len]``."""
        self._require("value", "compute_values")
        self._require_ready("compute_values")
        return self._forward_only(batch, OUTPUT_KEYS["value"], 1.0)

    @cpu_compat.on_cpu
    def compute_scores(self, batch: Batch) -> Batch:
        """``scores`` per sequence, ``[B]``."""
        self._require("score", "compute_scores")
        self._require_ready("compute_scores")
        return self._forward_only(batch, OUTPUT_KEYS["score"], 1.0)

    # -------------------------------------------------------------- train step
    def _loss_meta(self, batch: Batch, num_micro: int) -> dict[str, Any]:
        """The counts of :func:`~hf_core.engines.loss_totals.loss_totals` over the DP
        replicas (one rank of each: the DP group), and this replica's."""
        tokens = int(batch["response_mask"].sum()) if "response_mask" in batch else 0
        over_replicas = all_reduce_over(collective_device(), group=self._dp_group())
        return {
            **loss_totals([batch], over_replicas),
            "dp_size": self.layout.dp,
            "dp_rank": self.layout.coords.dp,
            "mini_batch_size": len(batch),
            "num_micro_batches": num_micro,
            "local_response_tokens": tokens,
        }

    @cpu_compat.on_cpu
    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimiser step over this replica's ``batch`` through megatron's pipeline
        schedule (``forward_backward_func``), in micro-batches of ``micro_batch_size``.

        ``loss_fn(outputs, micro_batch)`` runs on the last pipeline stage and returns the
        loss scaled as in the module docstring.  The actor's log-probs use
        ``batch.meta["temperature"]`` (default 1.0).  Returns, identically on every rank,
        the loss function's metrics and ``loss`` (averaged over micro-batches, summed for
        ``loss``, then averaged over DP replicas), ``grad_norm`` (global, before
        clipping), ``lr``, ``step`` and ``update_skipped``.
        """
        if self.optimizer is None:
            raise RuntimeError(
                "train_step on a frozen engine (trainable=False: reference / reward model)"
            )
        self._require_ready("train_step")
        self._refuse_router_losses(loss_fn)
        micro = self._micro_batches(batch)
        meta = self._loss_meta(batch, len(micro))
        for i, mb in enumerate(micro):
            mb.meta.update(meta, micro_batch_index=i, micro_batch_size=len(mb))
        temperature = float(batch.meta.get("temperature", 1.0))
        self.model.train()
        self._ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        routing_stats = moe_routing.RoutingStats()
        results = self._run(
            micro, loss_fn=loss_fn, temperature=temperature, routing_stats=routing_stats
        )
        # megatron's OptimizerParamScheduler counts steps differently: each param group's lr
        # is set from core's shared schedule instead, the same whichever backend trains
        lr = self.config.lr * self.config.lr_factor(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.config.weight_decay * group.get("wd_mult", 1.0)
        found_inf = self.optimizer.prepare_grads()
        grad_norm = self._clip_gradients()
        skipped = bool(found_inf) or not math.isfinite(grad_norm)
        if skipped:
            log.warning("step %d: gradient norm %s, update skipped", self.step, grad_norm)
        else:
            self.optimizer.step_with_ready_grads()
        self._ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.step += 1
        metrics = self._reduce_metrics(results, grad_norm, lr, skipped)
        if ROUTED_EXPERTS_KEY in batch:
            metrics.update(self._routing_metrics(routing_stats))
        return metrics

    def _routing_metrics(self, stats: moe_routing.RoutingStats) -> dict[str, float]:
        """Routing replay's metrics over every rank's MoE layers (``moe/router_agreement``,
        ``moe/expert_load_max_over_mean`` and its ``_max``), identical on every rank.  TP
        ranks count the same tokens alike, which leaves the ratios unchanged."""
        device = collective_device()
        ratios = stats.load_ratios
        sums = torch.tensor(
            [stats.matching, stats.compared, sum(ratios), len(ratios)],
            dtype=torch.float64,
            device=device,
        )
        worst = torch.tensor([max(ratios, default=0.0)], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        matching, compared, ratio_sum, count = (float(v) for v in sums.cpu())
        if not compared:
            return {}
        return {
            "moe/router_agreement": matching / compared,
            "moe/expert_load_max_over_mean": ratio_sum / max(count, 1.0),
            "moe/expert_load_max_over_mean_max": float(worst.cpu()[0]),
        }

    def _refuse_router_losses(self, loss_fn: LossFn) -> None:
        """``algorithm.moe_aux_loss_coef`` / ``moe_z_loss_coef`` (read off the actor's policy
        loss, as hf-fsdp does) are not applied on megatron yet: refused by name, never
        ignored."""
        algo = getattr(loss_fn, "algo", None)
        keys = ("moe_aux_loss_coef", "moe_z_loss_coef")
        set_keys = [k for k in keys if float(getattr(algo, k, 0.0) or 0.0) > 0]
        if set_keys and self.dims.is_moe:
            raise NotImplementedError(
                f"algorithm.{' / '.join(set_keys)} on the megatron engine: its router losses "
                "are not applied yet; set them to 0 or train the actor with backend fsdp"
            )

    def _clip_gradients(self) -> float:
        """The global gradient norm, before clipping, and the clip to ``grad_clip``.  Under
        expert parallelism megatron's optimizer chains one optimizer for the dense parameters
        and one for the experts (their gradients reduce over other groups): the norm is over
        both, and each clips by it, as ``ChainedOptimizer.step`` does."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        grad_norm = float(self.optimizer.get_grad_norm())
        if self.config.grad_clip:
            for sub in checkpoint.sub_optimizers(self.optimizer):
                params = sub.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(
                        params,
                        self.config.grad_clip,
                        grad_norm,
                        sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                    )
        return grad_norm

    def _reduce_metrics(
        self, results: list[dict[str, Any]], grad_norm: float, lr: float, skipped: bool
    ) -> dict[str, float]:
        local: dict[str, float] | None = None
        if self.is_output_rank and self.position.tp_rank == 0:
            local = combine_metric_rows(results, sums=("loss",))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        out = combine_metric_rows(g for g in gathered if g is not None)
        out.update(
            grad_norm=grad_norm, lr=float(lr), step=float(self.step), update_skipped=float(skipped)
        )
        return out

    # ------------------------------------------------------------ weight export
    def _native_params(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    @cpu_compat.on_cpu
    def export_slices(
        self, bucket_bytes: int, plan: RankPlan | ReshardPlan | None = None
    ) -> Iterator[list[CanonicalSlice]]:
        """The 3D-HybridEngine transition: this rank's generation shard, in buckets.

        ``plan`` is core's reshard plan (hybrid or naive) for this engine's layout; ``None``
        gathers the whole model on every rank.  Each slice is a whole canonical tensor
        (``t_g == 1``) or this rank's generation TP slice of one.  Every rank must consume
        its iterator to the end (it runs the all-gathers).  Statistics of the transition are
        in :attr:`reshard_stats` afterwards.
        """
        self._require_ready("export_weights")
        full = resolve_plan(self.layout.layout, plan, self.rank)
        export_dtype = to_dtype(self.config.export_dtype) if self.config.export_dtype else None
        expert_parallel = self.layout.ep > 1
        resharder = Resharder(
            params=self._native_params(),
            dims=self.dims,
            plan=full,
            rank=self.rank,
            padded_vocab=self.padded_vocab,
            export_dtype=export_dtype,
            experts=not expert_parallel,
        )
        self.reshard_stats = resharder.stats
        experts = None
        if expert_parallel:  # each EP rank contributes its own experts
            from megatron.core import parallel_state as ps

            experts = ExpertGather(
                params=self._native_params(),
                dims=self.dims,
                train=self.layout.layout,
                rank=self.rank,
                ep=self.layout.ep,
                rank_plan=full.for_rank(self.rank),
                gen=full.gen,
                padded_vocab=self.padded_vocab,
                group=ps.get_expert_tensor_and_model_parallel_group(),
                stats=resharder.stats,
                export_dtype=export_dtype,
            )
        yield from resharder.stream(bucket_bytes)
        if experts is not None:
            yield from experts.stream()

    def export_weights(
        self, bucket_bytes: int, plan: RankPlan | ReshardPlan | None = None
    ) -> Iterator[list[NamedTensor]]:
        """Canonical ``(hf_name, tensor)`` buckets; see :meth:`export_slices`.

        With a generation TP size above 1 the tensors are this rank's TP slices of those
        names (megatron's / vLLM's partition; :meth:`export_slices` says where each sits).
        """
        for bucket in self.export_slices(bucket_bytes, plan):
            yield [(s.name, s.tensor) for s in bucket]

    def export_hf(
        self, path: str | Path, tokenizer: str | Path | None = None, shard_bytes: int = 2 * 1024**3
    ) -> Path:
        """Write the model as a HuggingFace folder (every rank calls; rank 0 writes).

        ``tokenizer`` (a tokenizer folder; default ``config.tokenizer_path``) is saved alongside.
        """
        hf_config = copy.deepcopy(self.hf_config)
        hf_config.dtype = self.config.param_dtype
        if self.config.head != "lm":  # a critic may start from a causal-LM folder
            hf_config.num_labels = 1
        stream = ((s.name, s.tensor) for bucket in self.export_slices(shard_bytes) for s in bucket)
        return save_hf_folder(
            stream,
            path,
            hf_config,
            architecture_for(self.hf_config, self.config.head),
            shard_bytes=shard_bytes,
            tokenizer=tokenizer if tokenizer is not None else self.config.tokenizer_path,
            source_folder=self.folder,
        )

    # -------------------------------------------------------------- checkpoints
    @cpu_compat.on_cpu
    def save_checkpoint(self, path: str | Path) -> None:
        self._require_ready("save_checkpoint")
        checkpoint.save(path, self)

    @cpu_compat.on_cpu
    def load_checkpoint(self, path: str | Path) -> None:
        self._require_ready("load_checkpoint")
        self.step = checkpoint.load(path, self)

    # ------------------------------------------------------------------ offload
    @property
    def compute_dtype(self) -> torch.dtype:
        """Every parameter, and so the forward, is in ``param_dtype``."""
        return self.dtype

    def offload(self) -> int:
        """Move weights, gradients and optimiser state to host memory; the bytes moved (on
        the CPU nothing moves: the bytes a GPU run would).  Refuses work until :meth:`onload`,
        on the CPU too; a second call returns 0."""
        from hf_megatron.offload import offload_engine, resident_bytes

        if self._offloaded:
            return 0
        if self.on_gpu:
            moved = offload_engine(self)
        else:
            log.info("offload: the engine runs on the CPU, nothing to move")
            moved = resident_bytes(self)
        self._offloaded = True
        return moved

    def onload(self) -> int:
        """Undo :meth:`offload`; the bytes moved back (0 when not offloaded)."""
        from hf_megatron.offload import onload_engine, resident_bytes

        if not self._offloaded:
            return 0
        moved = onload_engine(self) if self.on_gpu else resident_bytes(self)
        self._offloaded = False
        return moved

    @property
    def offloaded(self) -> bool:
        return self._offloaded


def _params_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter in ``dtype``.  The local (non-Transformer-Engine) layer spec builds its
    norms with torch's default float32 whatever ``params_dtype`` says; Transformer Engine's
    norms and HF's bf16 checkpoints hold them in the model dtype, and the reshard gathers a
    training unit as one flat tensor of one dtype."""
    with torch.no_grad():
        for param in module.parameters():
            if param.dtype != dtype:
                param.data = param.data.to(dtype)


def _floats_stay_float32(tensor: torch.Tensor) -> torch.Tensor:
    """A forward-only output as returned: floating ones in float32, ids as they are."""
    return tensor.float() if tensor.is_floating_point() else tensor
