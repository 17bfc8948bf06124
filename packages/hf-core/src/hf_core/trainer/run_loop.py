"""What every trainer's run shares: the cluster, self-healing restarts, checkpoint cadence,
exact resume, validation cadence, metrics and the final export.

A trainer (:class:`~hf_core.trainer.rl.RLTrainer`, the supervised and preference trainers of
:mod:`hf_core.trainer.post_training`) is a :class:`RunLoop` that says what one step is
(:meth:`RunLoop._train_step`), what it validates, which engines it checkpoints and what its
driver state is.  The loop around it is written once, here, so a supervised fine-tuning run
restarts after a lost worker, resumes exactly and logs the same way an RL run does.

Self-healing: a worker that dies or hangs (:class:`~hf_core.runtime.WorkerLostError`) makes
:meth:`RunLoop.fit` tear the groups down, spawn fresh ones and resume from the latest
checkpoint (``run.max_restarts`` times at most); any other error propagates at once.
"""

from __future__ import annotations

import logging
import random
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_core.config import TrainerConfig
from hf_core.config.layout import RunLayout
from hf_core.metrics import MetricsLogger, RunSummary
from hf_core.runtime import Cluster, WorkerLostError
from hf_core.trainer.auto_placement import place_roles
from hf_core.trainer.checkpoint import (
    folder_bytes,
    latest_checkpoint,
    load_trainer_state,
    remove_partial_checkpoints,
    save_run_checkpoint,
)
from hf_core.trainer.out_of_memory import out_of_memory_error
from hf_core.trainer.preflight import preflight
from hf_core.trainer.spawning import PoolSpec, RoleGroups, spawn_roles

log = logging.getLogger(__name__)


class RunLoop(ABC):
    """One run: spawn the role groups, train ``run.total_steps`` steps, save and export.

    Subclasses implement the steps and the state; ``__init__`` resolves the layout (the
    pre-start checks) before any process starts, then calls :meth:`_new_run_state`.
    """

    def __init__(
        self, config: TrainerConfig, *, resume: bool = False, layout: RunLayout | None = None
    ) -> None:
        """``layout``: the recipe's layout as :func:`~hf_core.trainer.preflight.load_run_config`
        returned it with ``config``; ``None``: resolved here, by the pre-start checks."""
        self.layout = preflight(config, layout)
        """The run's layout: placement and every role worker take it from here."""
        self.config = config
        self.resume = resume
        self.output_dir = Path(config.run.output_dir)
        self.roles: RoleGroups | None = None
        self.step = 0
        self.restarts: list[str] = []
        """The cause of each self-healing restart of this run, in order."""
        self._last_metrics: dict[str, float] = {}
        """The last logged step's metrics (its stages' peak memory names an OOM's cause)."""
        self.start_steps: list[int] = []
        """The step each attempt of :meth:`fit` started training from, as restored (0: from
        scratch); ``start_steps[1:]`` is where each restart resumed.  The metrics cannot tell:
        a deterministic replay from step 0 logs the same rows as a resume."""
        self._checkpoint_step: int | None = None
        """Step of the newest checkpoint this run wrote or resumed from (None: none yet); a
        restart resumes only from such a one, never from a stale run's in the same folder."""
        self._last_save = time.monotonic()
        self._resume_now = resume
        """Whether the next attempt of :meth:`_fit` starts from the latest checkpoint."""

    # ------------------------------------------------------------ the steps
    @abstractmethod
    def _new_run_state(self) -> None:
        """The driver's training state at step 0 (a restart with no checkpoint goes back
        here): data loaders, controllers, ``self.step = 0``."""

    @abstractmethod
    def _train_step(self) -> dict[str, float]:
        """Step ``self.step`` (already advanced); its metrics."""

    def validate(self) -> dict[str, float]:
        """Held-out metrics (``val/...``), every ``run.val_every`` steps and at the end."""
        return {}

    def _has_validation(self) -> bool:
        return False

    def _headline_metrics(self) -> dict[str, Any]:
        """``progress_keys`` / ``plot_keys`` of the metrics logger where the trainer's own
        figures are not RL's (the reward and throughput); empty: the logger's defaults."""
        return {}

    def _start_attempt(self) -> None:
        """Set up what an attempt needs once its groups run, before any restore."""

    def _before_training(self, resumed_step: int | None) -> None:
        """After the restore (``None``: from scratch), before the first step."""

    def _end_attempt(self, failure: BaseException | None) -> None:
        """After the attempt ends, with the error that ended it (``None``: it finished)."""

    def _export(self) -> None:
        """The trained model as an HF folder under ``output_dir`` (``run.export_final``)."""

    # ------------------------------------------------------------ the state
    @abstractmethod
    def _state(self) -> dict[str, Any]:
        """The driver's state at ``self.step``: JSON values and tensors."""

    @abstractmethod
    def _save_engines(self, folder: Path) -> None:
        """Every trained engine's checkpoint into ``folder`` (its workers write it)."""

    @abstractmethod
    def _load(self, folder: Path, state: dict[str, Any]) -> None:
        """The engines and the driver state of the checkpoint in ``folder``; sets
        ``self.step``."""

    # --------------------------------------------------------------- the run
    @property
    def _groups(self) -> RoleGroups:
        if self.roles is None:
            raise RuntimeError("the worker groups exist only while fit() runs")
        return self.roles

    def fit(self) -> RunSummary:
        self._seed()
        remove_partial_checkpoints(self.output_dir)  # a failed or killed save's leftovers
        # auto: the planner's pools and layout
        placed = place_roles(self.config, self.layout, self.output_dir)
        self.config = cfg = placed.config
        self.layout = placed.layout
        with Cluster(cfg.cluster.address, num_cpus=cfg.cluster.num_cpus):
            return self._fit_with_restarts(placed.pools)

    def _seed(self) -> None:
        seed = self.config.run.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _fit_with_restarts(self, pools: list[PoolSpec]) -> RunSummary:
        """Spawn the groups and train; on a lost or hung worker, start over from the latest
        checkpoint with fresh groups, at most ``run.max_restarts`` times.

        Only :class:`WorkerLostError` restarts (a process died, or stopped answering within
        ``cluster.failure_timeout_s``): that is a fault of the machine, not of the program.
        Everything else propagates at once, with the groups torn down.
        """
        self._resume_now = self.resume
        while True:
            try:
                self.roles = spawn_roles(
                    self.config, self.layout, pools, stacks_dir=str(self.output_dir / "stacks")
                )
                return self._fit()
            except WorkerLostError as exc:
                if exc.out_of_memory:  # restarting would run the same step out of memory again
                    raise out_of_memory_error(exc, self._last_metrics) from None
                if len(self.restarts) >= self.config.run.max_restarts:
                    raise
                self._resume_now = self._prepare_restart(exc)
            finally:
                self._after_groups()
                if self.roles is not None:
                    self.roles.shutdown()
                    self.roles = None

    def _after_groups(self) -> None:
        """Drop what lived on the groups of the attempt that ended."""

    def _prepare_restart(self, cause: WorkerLostError) -> bool:
        """Log the restart and its cause; True to resume from a checkpoint, False to go back
        to step 0 (no checkpoint of this run exists yet)."""
        self.restarts.append(str(cause))
        resume = self._checkpoint_step is not None
        log.warning(
            "restart %d/%d after a worker failure at step %d, from %s: %s",
            len(self.restarts),
            self.config.run.max_restarts,
            self.step,
            f"the checkpoint of step {self._checkpoint_step}" if resume else "step 0",
            cause,
        )
        if not resume:
            self._seed()
            self._new_run_state()
        return resume

    def _save_due(self) -> bool:
        """Every ``save_every`` steps, and whenever ``save_every_minutes`` passed since the
        last save (bounding the work a fault can lose)."""
        run = self.config.run
        if run.save_every and self.step % run.save_every == 0:
            return True
        minutes = run.save_every_minutes
        return minutes is not None and time.monotonic() - self._last_save >= minutes * 60

    def _validation_due(self) -> bool:
        run = self.config.run
        return (
            self._has_validation()
            and bool(run.val_every)
            and (self.step % run.val_every == 0 or self.step == run.total_steps)
        )

    def _checkpoint(self) -> None:
        start = time.perf_counter()
        folder = self.save()
        log.info(
            "checkpoint of step %d saved in %.2f s (%d bytes): %s",
            self.step,
            time.perf_counter() - start,
            folder_bytes(folder),
            folder,
        )
        self._checkpoint_step = self.step
        self._last_save = time.monotonic()

    def _fit(self) -> RunSummary:
        """One attempt: restore (``--resume`` or a restart), train, save, export."""
        cfg = self.config
        self._start_attempt()
        resumed_step = self._restore() if self._resume_now else None
        self._last_save = time.monotonic()
        if resumed_step is not None:
            self._checkpoint_step = resumed_step
        self._before_training(resumed_step)
        self.start_steps.append(self.step)
        log.info("attempt %d trains from step %d", len(self.start_steps), self.step)
        logger = MetricsLogger(
            self.output_dir,
            total_steps=cfg.run.total_steps,
            run_name=cfg.run.name,
            config=cfg.model_dump(mode="json"),
            tensorboard=cfg.run.tensorboard,
            wandb=cfg.run.wandb,
            progress=cfg.run.progress,
            resume_step=resumed_step,
            overwrite=resumed_step is None,
            **self._headline_metrics(),
        )
        try:
            while self.step < cfg.run.total_steps:
                self.step += 1
                metrics = self._train_step()
                if self._validation_due():
                    metrics.update(self.validate())
                logger.log(metrics, self.step)
                self._last_metrics = metrics
                if self._save_due():
                    self._checkpoint()
            if cfg.run.save_final and self._checkpoint_step != self.step:
                self._checkpoint()
            if cfg.run.export_final:
                self._export()
        except BaseException as failure:
            logger.close()  # rows so far stay complete; no summary for a failed run
            self._end_attempt(failure)
            raise
        self._end_attempt(None)
        return logger.finish()

    # ----------------------------------------------------------- checkpoints
    def save(self) -> Path:
        keep = self.config.run.keep_checkpoints
        return save_run_checkpoint(
            self.output_dir, self.step, self._state(), self._save_engines, keep=keep
        )

    def _restore(self) -> int:
        start = time.perf_counter()
        folder = latest_checkpoint(self.output_dir)
        self._load(folder, load_trainer_state(folder))
        log.info(
            "resumed from %s at step %d, restored in %.2f s",
            folder,
            self.step,
            time.perf_counter() - start,
        )
        return self.step
