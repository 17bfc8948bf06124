"""Which trainer runs a recipe: ``trainer:`` names the dataflow."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_core.config import TrainerConfig
    from hf_core.trainer.run_loop import RunLoop


def trainer_class(config: TrainerConfig) -> type[RunLoop]:
    """The trainer of ``config.trainer`` (imported only when chosen)."""
    if config.trainer == "sft":
        from hf_core.trainer.sft import SFTTrainer

        return SFTTrainer
    if config.trainer == "reward_model":
        from hf_core.trainer.preference import RewardModelTrainer

        return RewardModelTrainer
    if config.trainer == "dpo":
        from hf_core.trainer.preference import DPOTrainer

        return DPOTrainer
    from hf_core.trainer.rl import RLTrainer

    return RLTrainer
