"""The critic worker: per-token values and the clipped value-loss update."""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.protocols import register
from hf_core.roles.common import (
    build_training_engine,
    mini_batch_updates,
    role_path,
    torch_threads,
    training_mesh,
)
from hf_core.roles.losses import ValueLoss
from hf_core.worker import Worker


class CriticWorker(Worker):
    def __init__(self, config: TrainerConfig, layout: RunLayout) -> None:
        """``layout``: the run's layout as the driver resolved it."""
        super().__init__()
        if config.critic is None:
            raise ValueError("CriticWorker needs a 'critic' section in the config")
        torch.set_num_threads(torch_threads(config))
        self.config = config
        self.critic = build_training_engine(
            config.critic, config, layout.role("critic"), head="value", trainable=True
        )
        self.loss = ValueLoss(config.algorithm)
        mesh = training_mesh(self.critic, self.mesh)
        if mesh != self.mesh:
            self.set_mesh(mesh)  # TP/PP critics: 3D_PROTO must broadcast inside TP/PP groups

    @register("3D_PROTO")
    def compute_values(self, batch: Batch) -> Batch:
        return Batch({"values": self.critic.compute_values(batch)["values"]})

    @register("3D_PROTO")
    def update_critic(self, batch: Batch) -> dict[str, float]:
        return mini_batch_updates(
            self.critic,
            batch,
            self.loss,
            epochs=self.config.algorithm.ppo_epochs,
            mini_batches=self.config.algorithm.mini_batches,
            seed=int(batch.meta.get("step", 0)) + 7,
        )

    @register("ONE_TO_ALL")
    def save_checkpoint(self, path: str) -> None:
        self.critic.save_checkpoint(role_path(path, "critic"))

    @register("ONE_TO_ALL")
    def load_checkpoint(self, path: str) -> None:
        self.critic.load_checkpoint(role_path(path, "critic"))
