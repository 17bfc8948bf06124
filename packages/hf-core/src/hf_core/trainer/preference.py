"""Training on preference pairs: a reward model (``trainer: reward_model``, Bradley-Terry on
the score head) and DPO (``trainer: dpo``, the policy against the reference).

Both dataflows are two calls per step.  A pair loss is nonlinear in its two rows, and the
engines may put a pair's rows in different micro-batches or on different data-parallel ranks,
so the driver first gets every row's value at the step's weights with a forward (the reward
model's scores; for DPO the policy's and the reference's summed response log-probs), computes
the loss and its derivative per pair, and sends each row its ``pair_weight``
(:func:`~hf_core.roles.preference_losses.pair_row_weights`).  The update then back-propagates
the weighted values (:class:`~hf_core.roles.preference_losses.LinearisedPairLoss`), whose
gradient is the pair loss's gradient exactly, however the rows fall.  The price is one more
forward per step, the one RL pays for its old log-probs.

Rows ``2i`` and ``2i + 1`` of a batch are pair ``i``'s chosen and rejected answers
(:mod:`hf_core.data.chat_tokens`).
"""

from __future__ import annotations

import time

import torch

from hf_core.algorithms.preference import bradley_terry_loss, dpo_metrics, pair_metrics
from hf_core.batch import Batch
from hf_core.data.chat_tokens import PreferenceDataset
from hf_core.data.loader import CollatingDataset
from hf_core.roles.preference_losses import (
    PAIR_WEIGHT_KEY,
    PairLoss,
    dpo_pair_loss,
    pair_row_weights,
    sequence_log_probs,
)
from hf_core.trainer.one_model import OneModelLoop

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
"""What a forward or an update reads of a pair batch."""


def _pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen (even rows) and rejected (odd rows) values."""
    return values[0::2], values[1::2]


def _interleave(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    return torch.stack([chosen, rejected], dim=1).reshape(-1)


class PairLoop(OneModelLoop):
    """A preference trainer: the pair values of a batch, and an update weighted by them."""

    def _dataset(self, files: list[str]) -> CollatingDataset:
        return PreferenceDataset.from_files(
            files, self.tokenizer, max_length=self.config.preference.max_length
        )

    def _model_input(self, batch: Batch) -> Batch:
        model_input = batch.select(*MODEL_KEYS)
        model_input.meta.update(batch.meta)
        return model_input

    def _row_values(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Each row's ``value`` at the current weights (a score, or a summed log-prob), and
        what else the pair loss reads (float64)."""
        raise NotImplementedError

    def _pair_loss(self, rows: dict[str, torch.Tensor]) -> tuple[PairLoss, dict[str, float]]:
        """The pair loss as a function of the chosen and rejected values, and the pair
        metrics at ``rows["value"]``."""
        raise NotImplementedError

    def _update(self, batch: Batch) -> list[dict[str, float]]:
        raise NotImplementedError

    prefix = "pairs"

    def _evaluate(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """Per-pair losses, the pair metrics and the row weights of ``batch``."""
        rows = self._row_values(self._model_input(batch))
        loss_of, metrics = self._pair_loss(rows)
        losses, chosen_w, rejected_w = pair_row_weights(*_pairs(rows["value"]), loss_of)
        return losses, metrics, _interleave(chosen_w, rejected_w)

    def _train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        batch = self._next_batch()
        losses, pair_metrics_, weights = self._evaluate(batch)
        update = self._model_input(batch)
        update[PAIR_WEIGHT_KEY] = weights.to(torch.float32)
        rows = self._update(update)
        metrics = self._step_metrics(rows, self.prefix, batch, start)
        metrics[f"{self.prefix}/loss"] = float(losses.mean())
        metrics.update({f"{self.prefix}/{k}": v for k, v in pair_metrics_.items()})
        return metrics

    def validate(self) -> dict[str, float]:
        """The pair loss and metrics over ``data.val_files``, weighted by pairs."""
        pairs, sums = 0, dict[str, float]()
        for batch in self._val_batches():
            losses, metrics, _ = self._evaluate(batch)
            n = len(losses)
            for key, value in {"loss": float(losses.mean()), **metrics}.items():
                sums[key] = sums.get(key, 0.0) + value * n
            pairs += n
        return {f"val/{k}": v / pairs for k, v in sums.items()} if pairs else {}


class RewardModelTrainer(PairLoop):
    """Bradley-Terry on ``reward.model``'s score head; exports ``reward_hf``, the
    ``reward.model.model_path`` of a PPO recipe."""

    role = "reward"
    prefix = "reward_model"
    headline = ("reward_model/loss", "reward_model/pair_accuracy")
    validation_headline = ("val/pair_accuracy",)

    def _row_values(self, batch: Batch) -> dict[str, torch.Tensor]:
        scores = self._trained.compute_scores(batch)["reward_scores"]
        return {"value": scores.to(torch.float64)}

    def _pair_loss(self, rows: dict[str, torch.Tensor]) -> tuple[PairLoss, dict[str, float]]:
        return bradley_terry_loss, pair_metrics(*_pairs(rows["value"]))

    def _update(self, batch: Batch) -> list[dict[str, float]]:
        return list(self._trained.update_scores(batch))


class DPOTrainer(PairLoop):
    """Direct preference optimisation of the actor against the frozen reference
    (``preference.loss``: sigmoid or ipo; ``preference.beta``)."""

    role = "actor"
    prefix = "dpo"
    headline = ("dpo/loss", "dpo/rewards/accuracy")
    validation_headline = ("val/rewards/accuracy", "val/rewards/margin")

    def _row_values(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The policy's and the reference's summed response log-probs (both forwards in
        flight at once)."""
        actor = self._groups.actor
        policy = actor.compute_log_probs.remote(batch)
        reference = actor.compute_ref_log_probs.remote(batch)
        mask = batch["response_mask"]
        return {
            "value": sequence_log_probs(policy.result()["old_log_probs"].double(), mask),
            "reference": sequence_log_probs(reference.result()["ref_log_probs"].double(), mask),
        }

    def _pair_loss(self, rows: dict[str, torch.Tensor]) -> tuple[PairLoss, dict[str, float]]:
        pref = self.config.preference
        ref_chosen, ref_rejected = _pairs(rows["reference"])
        loss = dpo_pair_loss(
            ref_chosen,
            ref_rejected,
            beta=pref.beta,
            loss_type=pref.loss,
            label_smoothing=pref.label_smoothing,
        )
        chosen, rejected = _pairs(rows["value"])
        metrics = dpo_metrics(chosen, rejected, ref_chosen, ref_rejected, beta=pref.beta)
        return loss, metrics

    def _update(self, batch: Batch) -> list[dict[str, float]]:
        return list(self._groups.actor.preference_step(batch))
