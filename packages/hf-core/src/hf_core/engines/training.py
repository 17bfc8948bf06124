"""The training engine interface: forward passes, a train step, weight export, checkpoints."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from hf_core.engines.weights import NamedTensor

if TYPE_CHECKING:
    from hf_core.batch import Batch
    from hf_core.resharding import RankPlan


class LossFn(Protocol):
    """A loss core passes to a training engine.

    Called once per micro-batch with the model outputs for it (``log_probs`` and ``entropy``
    for a policy, with ``log_probs_at_teacher_top_k`` when the micro-batch carries a
    teacher's top-k ids; ``values`` for a critic; per response token) and the micro-batch;
    returns the scalar loss to back-propagate (already scaled for the micro-batch's share of
    the mini-batch) and float metrics to average.
    """

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], micro_batch: Batch, /
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


class TrainingEngine(ABC):
    """One model's training-side engine, run SPMD on every rank of its worker group.

    Optional features (model-parallel mesh, HF export, offload, close) are the protocols of
    :mod:`hf_core.engines.capabilities`.
    """

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward computes in: a 16-bit one makes the log-probs differ from a
        rollout engine's by rounding (the trainer's rollout correction turns on)."""
        return torch.float32

    @abstractmethod
    def compute_log_probs(self, batch: Batch, temperature: float = 1.0, top_k: int = 0) -> Batch:
        """Per-token ``log_probs`` (and ``entropy``) of ``responses`` under the model; with
        ``top_k``, also its ``top_k`` likeliest ids and their log-probs per response
        position (``top_k_ids`` / ``top_k_log_probs``, ``[B, R, top_k]``).

        A training forward (``train_step``) of a batch carrying ``teacher_top_k_ids``
        ``[B, R, k]`` also hands its loss ``log_probs_at_teacher_top_k``, the model's
        log-probs at those ids with autograd (:mod:`hf_core.engines.top_k`)."""

    def compute_values(self, batch: Batch) -> Batch:
        """Per-token ``values`` of ``responses`` (value-head models)."""
        raise NotImplementedError(f"{type(self).__name__} has no value head")

    def compute_scores(self, batch: Batch) -> Batch:
        """A scalar ``scores`` per sequence (reward and cost models)."""
        raise NotImplementedError(f"{type(self).__name__} has no score head")

    @abstractmethod
    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimiser step over ``batch`` (split into micro-batches); returns metrics."""

    @abstractmethod
    def export_weights(
        self, bucket_bytes: int, plan: RankPlan | None = None
    ) -> Iterator[list[NamedTensor]]:
        """Stream canonical weights in buckets; with a plan, only what this rank must send."""

    @abstractmethod
    def save_checkpoint(self, path: str | Path) -> None:
        """Save model, optimiser, scheduler and RNG state (every rank calls this)."""

    @abstractmethod
    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote; a bad checkpoint is a clear error."""
