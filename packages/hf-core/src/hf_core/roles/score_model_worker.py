"""Reward- and cost-model workers: one scalar per sequence from a sequence-scoring head."""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_core.config import ModelRoleConfig, TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.protocols import register
from hf_core.roles.common import build_training_engine, torch_threads
from hf_core.worker import Worker


class ScoreModelWorker(Worker):
    """``kind`` names the output key: ``reward_scores`` or ``cost_scores``; ``model`` is the
    recipe's ``<kind>.model`` section, ``layout`` the run's layout as the driver resolved it."""

    def __init__(
        self, config: TrainerConfig, model: ModelRoleConfig, kind: str, layout: RunLayout
    ) -> None:
        super().__init__()
        torch.set_num_threads(torch_threads(config))
        self.kind = kind
        sizes = layout.role(f"{kind}.model")
        self.model = build_training_engine(model, config, sizes, head="score", trainable=False)

    @register("3D_PROTO")
    def compute_scores(self, batch: Batch) -> Batch:
        return Batch({f"{self.kind}_scores": self.model.compute_scores(batch)["scores"]})
