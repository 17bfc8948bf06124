"""Reward- and cost-model workers: one scalar per sequence from a sequence-scoring head.

Under ``trainer: reward_model`` the reward worker's engine is trainable and learns from
preference pairs (:meth:`ScoreModelWorker.update_scores`); every other run scores only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_core.batch import Batch
from hf_core.config import ModelRoleConfig, TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.engines import ExportsHF
from hf_core.protocols import register
from hf_core.roles.common import build_training_engine, role_path, torch_threads, training_mesh
from hf_core.roles.preference_losses import LinearisedPairLoss
from hf_core.worker import Worker


class ScoreModelWorker(Worker):
    """``kind`` names the output key: ``reward_scores`` or ``cost_scores``; ``model`` is the
    recipe's ``<kind>.model`` section, ``layout`` the run's layout as the driver resolved it."""

    def __init__(
        self, config: TrainerConfig, model: ModelRoleConfig, kind: str, layout: RunLayout
    ) -> None:
        super().__init__()
        torch.set_num_threads(torch_threads(config))
        self.config = config
        self.kind = kind
        self.trainable = config.trainer == "reward_model" and kind == "reward"
        sizes = layout.role(f"{kind}.model")
        self.model = build_training_engine(
            model, config, sizes, head="score", trainable=self.trainable
        )
        mesh = training_mesh(self.model, self.mesh)
        if mesh != self.mesh:
            self.set_mesh(mesh)  # TP/PP score models: 3D_PROTO broadcasts inside TP/PP groups

    @register("3D_PROTO")
    def compute_scores(self, batch: Batch) -> Batch:
        return Batch({f"{self.kind}_scores": self.model.compute_scores(batch)["scores"]})

    @register("3D_PROTO")
    def update_scores(self, batch: Batch) -> dict[str, float]:
        """One Bradley-Terry step: each row's score weighted by its ``pair_weight`` (the
        driver's derivative of the pair loss at these weights), exact under any split."""
        self._require_trainable("update_scores")
        return self.model.train_step(batch, LinearisedPairLoss("scores"))

    @register("ONE_TO_ALL")
    def save_checkpoint(self, path: str) -> None:
        self._require_trainable("save_checkpoint")
        self.model.save_checkpoint(role_path(path, self.kind))

    @register("ONE_TO_ALL")
    def load_checkpoint(self, path: str) -> None:
        self._require_trainable("load_checkpoint")
        self.model.load_checkpoint(role_path(path, self.kind))

    @register("ONE_TO_ALL")
    def export_hf(self, path: str) -> str:
        """The score model as an HF folder (``<kind>.model.model_path`` of a later run)."""
        if not isinstance(self.model, ExportsHF):
            raise NotImplementedError(f"{type(self.model).__name__} cannot export an HF folder")
        return str(self.model.export_hf(Path(path), tokenizer=str(self.config.tokenizer_path)))

    def _require_trainable(self, what: str) -> None:
        if not self.trainable:
            raise RuntimeError(
                f"{what}: the {self.kind} model is frozen here (only trainer: reward_model "
                "trains the reward model)"
            )
