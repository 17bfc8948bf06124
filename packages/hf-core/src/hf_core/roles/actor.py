"""The hybrid actor worker: policy training, rollout and (optionally) the reference policy.

One process per rank holds the actor's training engine and its rollout engine side by side
(the paper's hybrid engine): after each update the new weights stream from the training
engine into the rollout engine in buckets, in the same process, with no second full copy
(:mod:`hf_core.sync.hybrid`), and the device memory changes hands every step
(:mod:`hf_core.roles.handover`): training state is offloaded while the rollout engine
generates, the rollout engine's weights and KV cache are released while the model trains.

With ``placement.mode: standalone`` the rollout engines live in a pool of their own
(:mod:`hf_core.roles.rollout_pool`); this worker then holds no rollout engine and sends its
weights to that pool over a broadcast group instead (:mod:`hf_core.sync.broadcast`).  Either
way the worker holds one :class:`~hf_core.sync.WeightSync`, chosen at init (in-process, LoRA
adapters only, or broadcast), and the trainer calls one method for it: :meth:`sync_weights`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hf_core.algorithms.distill_top_k import TOP_K_LOSSES
from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.engines import (
    ExportsHF,
    GenerationRank,
    HasGenerationRank,
    RolloutEngine,
    SamplingParams,
    TrainsAdapters,
)
from hf_core.engines.dtypes import to_dtype
from hf_core.engines.hf_folder import read_model_config
from hf_core.engines.top_k import (
    TEACHER_TOP_K_IDS,
    TEACHER_TOP_K_LOG_PROBS,
    TOP_K_IDS,
    TOP_K_LOG_PROBS,
    compact_top_k,
)
from hf_core.planner.models import from_hf_config
from hf_core.plugins import get_engine_parallelism, get_rollout_engine
from hf_core.protocols import register
from hf_core.roles.adapters import base_model, reference_is_actor_base
from hf_core.roles.common import (
    build_agent_loop,
    build_training_engine,
    mini_batch_updates,
    role_path,
    rollout_engine_args,
    torch_threads,
    training_mesh,
)
from hf_core.roles.handover import MemoryHandover
from hf_core.roles.losses import PolicyLoss, rollout_is_cap, rollout_is_mode, sft_loss
from hf_core.roles.preference_losses import LinearisedPairLoss
from hf_core.sync import (
    BroadcastSync,
    ChannelAddress,
    WeightSync,
    WireEncoder,
    lora_of,
    weight_sync_for,
)
from hf_core.worker import Worker


class ActorRolloutRefWorker(Worker):
    """Actor (trainable policy) + rollout engine (+ frozen reference) in one process.

    ``layout`` is the run's layout as the driver resolved it (it arrives with the config):
    the engines, the weight sync and the reported mesh all follow it."""

    def __init__(self, config: TrainerConfig, layout: RunLayout) -> None:
        super().__init__()
        torch.set_num_threads(torch_threads(config))
        self.config = config
        self.layout = layout
        self.actor = build_training_engine(
            config.actor, config, layout.role("actor"), head="lm", trainable=True
        )
        # a LoRA actor's base model is the reference: adapters disabled, no second copy
        self.reference_is_base = reference_is_actor_base(config, self.actor)
        self.reference = (
            build_training_engine(
                config.reference, config, layout.role("reference"), head="lm", trainable=False
            )
            if config.reference is not None and not self.reference_is_base
            else None
        )
        self.teacher = (
            build_training_engine(
                config.teacher, config, layout.role("teacher"), head="lm", trainable=False
            )
            if config.teacher is not None
            else None
        )
        """On-policy distillation's teacher: scores the student's samples per token."""
        self.teacher_vocab_size = (
            from_hf_config(
                read_model_config(config.role_model(config.teacher), key="teacher.model_path")
            ).vocab_size
            if config.teacher is not None
            else 0
        )
        """Sizes the integer type the teacher's top-k ids are stored in."""
        self.standalone = config.placement.mode == "standalone"
        generates = config.trainer == "rl" and not self.standalone
        """Supervised and preference trainers never sample: no rollout engine then (and the
        unused weight sync below is a broadcast whose channel is never opened)."""
        self.rollout = self._build_rollout(config, layout) if generates else None
        self.agent = (
            None
            if self.rollout is None
            else build_agent_loop(config, layout.generation, self.rollout, lambda: self.updates)
        )
        """Multi-turn tool-using rollouts around the rollout engine (None: single-turn)."""
        self.loss = self._policy_loss(getattr(self.rollout, "compute_dtype", None))
        self.needs_sync = False
        self.updates = 0
        """Policy updates applied (the policy version): a broadcast to a rollout pool carries
        it, so the pool knows which weights it generates with, independently of the trainer."""
        self._report_mesh()
        self.weight_sync: WeightSync = weight_sync_for(
            self.actor,
            self.rollout,
            bucket_bytes=int(config.rollout.bucket_mb * 2**20),
            kind=config.rollout.reshard,
            rank=self.rank,
            device=self.device,
            generation=layout.generation,
            encoder=WireEncoder(
                delta=config.rollout.sync == "delta",
                full_every=config.rollout.sync_full_every,
                verify=config.rollout.sync_verify,
            ),
        )
        """How the weights reach the rollout engine: in this process, or broadcast to a pool."""
        self.handover = MemoryHandover(self.actor, self.reference, self.rollout, self.teacher)

    @staticmethod
    def _build_rollout(config: TrainerConfig, layout: RunLayout) -> RolloutEngine:
        factory = get_rollout_engine(config.rollout.backend)
        return factory(**rollout_engine_args(config, layout.generation), **config.rollout.engine)

    def _policy_loss(self, rollout_dtype: torch.dtype | None) -> PolicyLoss:
        """The policy loss, its rollout correction following both engines' resolved dtypes
        (``algorithm.rollout_is: auto``)."""
        dtypes = (self.actor.compute_dtype, rollout_dtype)
        return PolicyLoss(
            self.config.algorithm,
            is_cap=rollout_is_cap(self.config, *dtypes),
            is_mode=rollout_is_mode(self.config, *dtypes) or "truncated",
        )

    def _rollout(self) -> RolloutEngine:
        """The in-process rollout engine (not in a standalone placement)."""
        if self.rollout is None:
            raise RuntimeError(
                "this actor has no rollout engine (placement.mode: standalone): generation "
                "runs in the rollout pool"
            )
        return self.rollout

    def _report_mesh(self) -> None:
        """Tell the controller how this rank is laid out, so the 3D protocols route data.

        Training coordinates come from the actor engine when it has model parallelism
        (:class:`HasWorkerMesh`, e.g. megatron's TP/PP/DP); generation coordinates from the
        run's resolved generation layout when the rollout engine can span ranks (it declares
        ``tp``), checked against what the engine built (:class:`HasGenerationRank`).  Without
        either, both follow plain data parallelism.
        """
        mesh = training_mesh(self.actor, self.mesh)
        backend = self.config.rollout.backend
        if self.rollout is not None and "tp" in get_engine_parallelism("rollout", backend):
            layout = self.layout.generation
            place = GenerationRank.of(layout, self.rank, self.world_size)
            if isinstance(self.rollout, HasGenerationRank):
                built = self.rollout.generation_rank()
                if built != place:
                    raise RuntimeError(
                        f"rank {self.rank}: the {backend!r} rollout engine formed {built}, but "
                        f"the run's generation layout {layout} places this rank at {place}"
                    )
            mesh = dataclasses.replace(
                mesh,
                gen_dp_rank=place.dp_rank,
                gen_dp_size=place.dp_size,
                gen_tp_rank=place.tp_rank,
                gen_tp_size=place.tp_size,
            )
        if mesh != self.mesh:
            self.set_mesh(mesh)

    # ------------------------------------------------------------- generation
    @register("3D_ALL_MICRO_DP")
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample responses; syncs weights first if the actor changed since the last sync.

        The rollout engine owns the device while it generates (training state offloaded);
        afterwards the training engines get it back for log-probs and updates.
        """
        rollout = self._rollout()
        if self.needs_sync:
            self.sync_weights()
        with self.handover.stage("generate"):
            self.handover.to_generation()
            out = (self.agent or rollout).generate(prompts, params)
        self.handover.to_training()
        return out

    @register("ONE_TO_ALL")
    def sync_weights(self) -> dict[str, float]:
        """The actor's weights (policy version :attr:`updates`) into the rollout engine, by
        this worker's :attr:`weight_sync` (see :mod:`hf_core.sync`); this rank's sync metrics.

        In-process, the rollout engine's memory comes back first (its weights are written in
        place); once the weights are in it, the training state leaves the device until the
        next update, so generation starts with the device to itself.  To a rollout pool (its
        ``receive_weights`` runs at the same time) the training state stays.
        """
        with self.handover.stage("weight_sync"):
            self.handover.to_training()
            self.handover.resume_rollout()
            metrics = self.weight_sync.run(self.updates)
            self.handover.after_sync()
        self.needs_sync = False
        return metrics

    # ------------------------------------------- standalone rollout pool
    @register("RANK_ZERO")
    def open_weight_channel(self, nodes: list[str]) -> ChannelAddress:
        """Rank 0 opens the channel's store for rollout ranks on ``nodes`` (one node key per
        rank: the relay tree sends each node one copy)."""
        return self._broadcast().listen(nodes)

    @register("ONE_TO_ALL")
    def follow_rollout_dtype(self, dtype: torch.dtype | None) -> None:
        """The standalone pool's engines computed in ``dtype`` (their resolved setting, e.g. a
        rollout ``dtype: auto``): the rollout correction follows it as in a hybrid run, and
        the weights travel in it (what the pool would round them to anyway)."""
        self.loss = self._policy_loss(dtype)
        if isinstance(self.weight_sync, BroadcastSync):
            self.weight_sync.encoder.wire_dtype = dtype

    @register("ONE_TO_ALL")
    def join_weight_channel(self) -> None:
        """Rank 0 joins the broadcast group (with the rollout ranks' joins in flight)."""
        self._broadcast().join()

    def _broadcast(self) -> BroadcastSync:
        """The sync to the rollout pool, whose channel the two calls above set up."""
        if not isinstance(self.weight_sync, BroadcastSync):
            raise RuntimeError("weights go to a rollout pool only with placement.mode: standalone")
        return self.weight_sync

    @register("ONE_TO_ALL")
    def take_handover_log(self) -> dict[str, object]:
        """The memory hand-over since the last call: the ordered events (engine, action,
        bytes) and each stage's peak memory; the log starts afresh."""
        return self.handover.take_log()

    # ---------------------------------------------------------- log-probs
    @register("3D_PROTO")
    def compute_log_probs(self, batch: Batch) -> Batch:
        """The behaviour policy's log-probs (``old_log_probs``) and entropy."""
        self.handover.to_training()
        out = self.actor.compute_log_probs(batch, temperature=self._temperature(batch))
        return Batch({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register("3D_PROTO")
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        self.handover.to_training()
        if self.reference_is_base:
            with base_model(self.actor):
                out = self.actor.compute_log_probs(batch, temperature=self._temperature(batch))
            return Batch({"ref_log_probs": out["log_probs"]})
        if self.reference is None:
            raise RuntimeError("no reference model configured (add a 'reference' section)")
        out = self.reference.compute_log_probs(batch, temperature=self._temperature(batch))
        return Batch({"ref_log_probs": out["log_probs"]})

    @register("3D_PROTO")
    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """The teacher's log-probs of the student's sampled tokens (distillation), and with a
        top-k loss its top-k ids and log-probs per response token, stored compactly
        (:func:`~hf_core.engines.top_k.compact_top_k`)."""
        self.handover.to_training()
        if self.teacher is None:
            raise RuntimeError("no teacher model configured (add a 'teacher' section)")
        distill = self.config.algorithm.distill
        top_k = distill.top_k if distill.loss in TOP_K_LOSSES else 0
        out = self.teacher.compute_log_probs(
            batch, temperature=self._temperature(batch), top_k=top_k
        )
        result = Batch({"teacher_log_probs": out["log_probs"]})
        if top_k:
            ids, log_probs = compact_top_k(
                out[TOP_K_IDS],
                out[TOP_K_LOG_PROBS],
                self.teacher_vocab_size,
                to_dtype(distill.top_k_dtype),
            )
            result[TEACHER_TOP_K_IDS], result[TEACHER_TOP_K_LOG_PROBS] = ids, log_probs
        return result

    def _temperature(self, batch: Batch) -> float:
        return float(batch.meta.get("temperature", self.config.rollout.temperature)) or 1.0

    # ------------------------------------------------------------- updates
    @register("3D_PROTO")
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs x mini-batches over this rank's share; weights sync before next rollout."""
        batch.meta.setdefault("temperature", self._temperature(batch))
        self.handover.to_training()
        with self.handover.stage("update_actor"):
            metrics = mini_batch_updates(
                self.actor,
                batch,
                self.loss,
                epochs=self.config.algorithm.ppo_epochs,
                mini_batches=self.config.algorithm.mini_batches,
                seed=int(batch.meta.get("step", 0)),
            )
        self.updates += 1
        self.needs_sync = True
        return metrics

    @register("3D_PROTO")
    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One supervised step (prompt -> target tokens as the 'response')."""
        batch.meta["temperature"] = 1.0
        self.handover.to_training()
        metrics = self.actor.train_step(batch, sft_loss)
        self.needs_sync = True
        return metrics

    @register("3D_PROTO")
    def preference_step(self, batch: Batch) -> dict[str, float]:
        """One DPO step: each row's summed log-prob weighted by its ``pair_weight`` (the
        driver's derivative of the pair loss at these weights), so any split of the pairs
        over micro-batches and ranks gives the pair loss's exact gradient."""
        batch.meta["temperature"] = 1.0
        self.handover.to_training()
        metrics = self.actor.train_step(batch, LinearisedPairLoss("log_probs"))
        self.updates += 1
        self.needs_sync = True
        return metrics

    # ---------------------------------------------------------- checkpoints
    @register("ONE_TO_ALL")
    def save_checkpoint(self, path: str) -> None:
        self.handover.to_training()
        self.actor.save_checkpoint(role_path(path, "actor"))

    @register("ONE_TO_ALL")
    def load_checkpoint(self, path: str, updates: int) -> None:
        """The actor's state from a run checkpoint taken after ``updates`` policy updates
        (the checkpoint's step), which becomes the policy version again."""
        self.handover.to_training()
        self.actor.load_checkpoint(role_path(path, "actor"))
        self.updates = updates
        self.needs_sync = True
        if isinstance(self.weight_sync, BroadcastSync):
            self.weight_sync.restart_chain()  # a delta on the old weights means nothing now

    @register("ONE_TO_ALL")
    def export_hf(self, path: str) -> str:
        """The actor as an HF folder (a LoRA actor: merged weights, and its adapters in peft
        format in ``<path>/adapter``)."""
        if not isinstance(self.actor, ExportsHF):
            raise NotImplementedError(f"{type(self.actor).__name__} cannot export an HF folder")
        self.handover.to_training()
        out = self.actor.export_hf(Path(path), tokenizer=str(self.config.tokenizer_path))
        if lora_of(self.actor) is not None and isinstance(self.actor, TrainsAdapters):
            self.actor.export_adapter_folder(out / "adapter")
        return str(out)
