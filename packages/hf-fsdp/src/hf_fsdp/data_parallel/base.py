"""The data-parallel interface of the FSDP engine: how its ranks hold the model and combine
their work.

The engine is written once against :class:`DataParallel` (chosen when the engine is built,
:func:`hf_fsdp.data_parallel.build.build`); a strategy decides where the model's weights
live, which process computes which rank's batch, and what a computation combines with the
other ranks (:class:`Peers`).  The engine's own code -- micro-batches, forwards, the loss
scaling, the optimizer step -- never asks which strategy runs.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.distributed as dist
from torch import nn

from hf_core.batch import Batch
from hf_core.device import collective_device
from hf_core.engines import combine_metric_rows
from hf_core.engines.loss_totals import all_reduce_over, loss_totals
from hf_core.engines.memory_fit import MicroBatchFit
from hf_fsdp.distributed import all_gather_objects, all_reduce_int


@dataclass(frozen=True)
class Share:
    """One data-parallel rank's batch as a process computes it: which rank of how many."""

    batch: Batch
    dp_rank: int
    dp_size: int


class Peers(ABC):
    """What one computation combines with: the other ranks (collectives), or nothing when
    this process computes every rank's batch."""

    across_ranks: ClassVar[bool]
    """Whether the gradient norm is reduced over the ranks (each holds gradients)."""

    def agree(self, value: int, op: dist.ReduceOp) -> int:
        """``value`` combined over the ranks that compute."""
        raise NotImplementedError

    def loss_totals(self, batches: Sequence[Batch]) -> dict[str, Any]:
        """The global counts a loss scales by (:func:`hf_core.engines.loss_totals.loss_totals`)."""
        raise NotImplementedError

    def metrics(self, row: dict[str, float]) -> dict[str, float]:
        """This computation's metrics combined with the other ranks'."""
        raise NotImplementedError


class AllRanks(Peers):
    """Every rank computes its own batch; counts and metrics go through collectives over the
    default group.  ``copies``: ranks holding one batch (a sequence-parallel group)."""

    across_ranks = True

    def __init__(self, copies: int = 1) -> None:
        self.copies = copies

    def agree(self, value: int, op: dist.ReduceOp) -> int:
        return all_reduce_int(value, op)

    def loss_totals(self, batches: Sequence[Batch]) -> dict[str, Any]:
        return loss_totals(batches, all_reduce_over(collective_device(), copies=self.copies))

    def metrics(self, row: dict[str, float]) -> dict[str, float]:
        return combine_metric_rows(all_gather_objects(row))


class ThisProcess(Peers):
    """This process computes every rank's batch: nothing to combine with (no collective)."""

    across_ranks = False

    def agree(self, value: int, op: dist.ReduceOp) -> int:
        return value

    def loss_totals(self, batches: Sequence[Batch]) -> dict[str, Any]:
        return loss_totals(batches)

    def metrics(self, row: dict[str, float]) -> dict[str, float]:
        return row


UpdateResult = tuple[dict[str, float], MicroBatchFit | None, bool]
"""An update's metrics, and the micro-batch fit and checkpointing it ran with (the ranks share
them, whichever process computed)."""
Update = Callable[[list[Share], Peers], UpdateResult]
"""The engine's update (gradients and optimizer step) of these shares."""
Forward = Callable[[list[Batch], Peers], list[Batch]]
"""The engine's forward-only pass over each batch, its outputs in the same order."""


class DataParallel(ABC):
    """One strategy.  Every rank of the group calls every method together, in one order."""

    name: ClassVar[str]
    """What the engine reports (``data_parallel/<name>`` in its update metrics)."""

    def __init__(self, rank: int, world: int, sequence_parallel: int = 1) -> None:
        self.rank, self.world, self.sequence_parallel = rank, world, sequence_parallel
        self.collectives = "process_group"
        """``shared_memory`` where this strategy's collectives copy through a /dev/shm file."""
        self.state_ranks = 1
        """How many ranks the training state is divided over (the micro-batch fit's)."""
        self.growing_processes: int | None = None
        """Processes of the node whose memory grows in an update (None: all of the group's)."""
        self.holds_optimizer = True
        """Whether this rank steps the optimizer (and so holds its state)."""
        self._peers = AllRanks(sequence_parallel)

    def prepare(self, model: nn.Module) -> None:
        """Wrap ``model`` before its weights are loaded (its parameters on the meta device)."""

    def loaded(self, model: nn.Module) -> None:
        """``model``'s weights are loaded (collective)."""

    def forward(self, batch: Batch, forward: Forward) -> Batch:
        """This rank's outputs of a forward-only pass over ``batch``."""
        return forward([batch], self._peers)[0]

    def train(self, batch: Batch, update: Update) -> UpdateResult:
        """One update with this rank's ``batch`` in it."""
        sp = self.sequence_parallel  # the ranks of a sequence-parallel group share one chunk
        return update([Share(batch, self.rank // sp, self.world // sp)], self._peers)

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """After the backward, before the norm: make the gradients the ranks' mean where the
        backward did not (FSDP's does)."""

    def release(self, model: nn.Module) -> None:
        """After a forward-only pass (and before reading the weights): drop what it gathered."""

    def publish(self) -> None:
        """Before every rank reads the weights (an export, a weight sync, a checkpoint)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world={self.world})"
