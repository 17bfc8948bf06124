"""Pieces every role worker shares: building engines by name, the PPO epoch/mini-batch loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.config import ModelRoleConfig, TrainerConfig
from hf_core.engines import HasWorkerMesh, LossFn, TrainingEngine
from hf_core.plugins import get_training_engine
from hf_core.protocols import WorkerMesh


def build_training_engine(
    role: ModelRoleConfig, config: TrainerConfig, *, head: str, trainable: bool
) -> TrainingEngine:
    """Create the role's engine through the plugin registry.

    Every training engine factory takes ``model_path``, ``head``, ``trainable`` and ``seed``;
    the role's ``engine:`` block adds backend-specific settings.
    """
    factory = get_training_engine(role.backend)
    core = training_engine_args(config, role, head=head, trainable=trainable)
    return factory(**{**core, **role.engine})


def training_engine_args(
    config: TrainerConfig, role: ModelRoleConfig, *, head: str, trainable: bool
) -> dict[str, Any]:
    """The keys core passes to every training engine factory; the role's ``engine:`` block
    is added on top (it may override ``seed``, nothing else core sets)."""
    return {
        "model_path": str(config.role_model(role)),
        "head": head,
        "trainable": trainable,
        "seed": config.run.seed,
    }


def mini_batch_updates(
    engine: TrainingEngine,
    batch: Batch,
    loss_fn: LossFn,
    *,
    epochs: int,
    mini_batches: int,
    seed: int,
) -> dict[str, float]:
    """``epochs`` passes over this rank's batch, ``mini_batches`` optimizer steps each.

    The order inside an epoch is a seeded permutation (same on every run, so resumed runs
    repeat it); metrics are averaged over all optimizer steps.
    """
    sums: dict[str, float] = {}
    steps = 0
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed(seed * 1000 + epoch)
        order = torch.randperm(len(batch), generator=generator)
        for part in batch.index(order).chunk(mini_batches):
            metrics = engine.train_step(part, loss_fn)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            steps += 1
    return {key: value / steps for key, value in sums.items()}


def training_mesh(engine: TrainingEngine, default: WorkerMesh) -> WorkerMesh:
    """The engine's own TP/PP/DP coordinates if it has model parallelism, else ``default``."""
    return engine.worker_mesh() if isinstance(engine, HasWorkerMesh) else default


def role_path(path: str | Path, role: str) -> Path:
    return Path(path) / role
