"""What the supervised and preference trainers share: one trained model, a dataset read in
resumable batches, and a checkpoint of that model plus the loader's position.

Each is a :class:`~hf_core.trainer.run_loop.RunLoop`, so it restarts after a lost worker,
resumes exactly and logs like an RL run; what differs is the data (:meth:`_dataset`) and the
step.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_core.batch import Batch
from hf_core.config import TRAINED_ROLE, TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.data import DataError, PromptLoader
from hf_core.data.loader import CollatingDataset
from hf_core.engines import rank_zero_row
from hf_core.metrics import peak_memory
from hf_core.rng import rng_state, set_rng_state
from hf_core.runtime import WorkerGroup
from hf_core.trainer.batches import token_count
from hf_core.trainer.run_loop import RunLoop


class OneModelLoop(RunLoop):
    """A run that trains one model (:meth:`_trained`) on a dataset of examples.

    ``data.batch_size`` examples (pairs for the preference trainers) per step; ``run.val_every``
    steps, the whole of ``data.val_files``.
    """

    role = "actor"
    """The worker group trained (``actor``, or ``reward`` for a reward model)."""

    def __init__(
        self, config: TrainerConfig, *, resume: bool = False, layout: RunLayout | None = None
    ) -> None:
        from transformers import AutoTokenizer

        super().__init__(config, resume=resume, layout=layout)
        data = config.data
        if not data.train_files:
            raise DataError(
                f"data.train_files is empty: trainer: {config.trainer} needs at least one "
                "JSONL/Parquet file"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(config.tokenizer_path), local_files_only=True
        )
        self.train_set = self._dataset([str(p) for p in data.train_files])
        self.val_set = self._dataset([str(p) for p in data.val_files]) if data.val_files else None
        self._new_run_state()

    @abstractmethod
    def _dataset(self, files: list[str]) -> CollatingDataset:
        """The examples of ``files``, tokenized (a bad row is a DataError naming file and row)."""

    def _new_run_state(self) -> None:
        config = self.config
        self.loader = PromptLoader(
            self.train_set,
            config.data.batch_size,
            shuffle=config.data.shuffle,
            seed=config.run.seed,
            num_epochs=config.data.num_epochs,
        )
        self.step = 0

    def _next_batch(self) -> Batch:
        try:
            batch = next(self.loader)
        except StopIteration:
            raise DataError(
                f"data.train_files ran out after {self.loader.batches_done} batches "
                f"(data.num_epochs={self.config.data.num_epochs}) before run.total_steps="
                f"{self.config.run.total_steps}: raise data.num_epochs"
            ) from None
        batch.meta["step"] = self.step
        return batch

    def _val_batches(self) -> Iterator[Batch]:
        if self.val_set is None:
            return iter(())
        loader = PromptLoader.for_validation(
            self.val_set,
            self.config.data.val_batch_size,
        )
        return iter(loader)

    def _has_validation(self) -> bool:
        return self.val_set is not None

    headline: tuple[str, ...] = ("actor/loss",)
    """The step's figures shown beside the progress bar, plotted and summarised (with their
    ``val/`` counterparts and the throughput)."""

    def _headline_metrics(self) -> dict[str, Any]:
        keys = (*self.headline, *self.validation_headline, "perf/throughput")
        return {"progress_keys": keys, "plot_keys": keys}

    validation_headline: tuple[str, ...] = ()

    @property
    def _trained(self) -> WorkerGroup:
        return self._groups.actor if self.role == "actor" else self._require(self._groups.reward)

    @staticmethod
    def _require(group: WorkerGroup | None) -> WorkerGroup:
        if group is None:
            raise RuntimeError("the trained model's worker group was not spawned")
        return group

    @staticmethod
    def _step_metrics(
        rows: list[dict[str, float]], prefix: str, batch: Batch, start: float
    ) -> dict[str, float]:
        """The update's rank-0 row (engines all-reduce it) under ``prefix``, plus throughput
        and memory, as an RL step logs them."""
        elapsed = time.perf_counter() - start
        tokens = token_count(batch)
        return {
            **{f"{prefix}/{k}": v for k, v in rank_zero_row(rows).items()},
            "perf/step_s": elapsed,
            "perf/tokens": float(tokens),
            "perf/throughput": tokens / elapsed,
            **peak_memory(),
        }

    # ----------------------------------------------------------- the state
    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "loader": self.loader.state_dict(), "rng": rng_state()}

    def _save_engines(self, folder: Path) -> None:
        self._trained.save_checkpoint(str(folder))

    def _load(self, folder: Path, state: dict[str, Any]) -> None:
        if self.role == "actor":
            self._groups.actor.load_checkpoint(str(folder), int(state["step"]))
        else:
            self._trained.load_checkpoint(str(folder))
        self.step = int(state["step"])
        self.loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])

    def _export(self) -> None:
        name = TRAINED_ROLE[self.config.trainer].split(".")[0]
        self._trained.export_hf(str(self.output_dir / f"{name}_hf"))
