"""Which data-parallel strategy an FSDP engine's settings resolve to.

One rule for the engine, when it is built (:func:`hf_fsdp.data_parallel.build.build`), and
for the pre-start memory check, before any process starts
(``FSDPEngineConfig.state_bytes_per_rank``).  The engine may still fall back to FSDP2 where a
CPU strategy's run-time needs fail (ranks on one host, a shared-memory file every rank maps).

- ``fsdp2``: FSDP2 shards.  GPUs always, and CPU ranks by default
  (``cpu_data_parallel: auto``): the path a GPU run takes is the one every multi-rank
  feature is tested on.
- ``cpu_replicas``: a plain module per rank, gradients averaged through shared memory
  (:mod:`hf_fsdp.data_parallel.cpu_replicas`; ``replicate``, where the copies fit).  One CPU
  process always trains a plain module: it has nothing to shard, and FSDP's copies cost it
  a large share of the update (docs/performance.md, "Measured choices").
- ``cpu_leader``: the host's first rank trains for every rank
  (:mod:`hf_fsdp.data_parallel.cpu_leader`; ``leader``).

Nothing here imports the engine's configuration: settings are read through
:class:`DataParallelSettings`, so ``hf_fsdp.config`` can use the rule without a cycle.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hf_core.engines.memory_fit import node_memory_bytes

FSDP2 = "fsdp2"
CPU_REPLICAS = "cpu_replicas"
CPU_LEADER = "cpu_leader"
STRATEGIES = (FSDP2, CPU_REPLICAS, CPU_LEADER)
"""Every strategy's name; ranks that disagree take the first of theirs in this order (FSDP2
needs nothing every rank must share)."""

REPLICA_MEMORY_SHARE = 0.25
"""Largest share of the host's memory the ranks' replicated training state may take."""


class DataParallelSettings(Protocol):
    """The engine settings the rule reads (``hf_fsdp.config.FSDPEngineConfig``)."""

    @property
    def cpu_data_parallel(self) -> str: ...

    @property
    def cpu_collectives(self) -> str: ...

    @property
    def sequence_parallel_size(self) -> int: ...

    @property
    def trainable(self) -> bool: ...

    @property
    def lora(self) -> object: ...

    @property
    def torch_param_dtype(self) -> torch.dtype: ...

    def mixed_precision_dtype(self, device: torch.device) -> torch.dtype | None: ...


def training_state_bytes(settings: DataParallelSettings, num_params: int, trainable: bool) -> int:
    """A whole model's weights, and when ``trainable`` its gradients and Adam moments."""
    copies = 4 if trainable else 1
    return copies * settings.torch_param_dtype.itemsize * num_params


def replica_state_bytes(settings: DataParallelSettings, num_params: int) -> int:
    """One replica's state: everything for full fine-tuning, the frozen weights for LoRA
    (its adapters' state is tiny)."""
    return training_state_bytes(settings, num_params, settings.trainable and settings.lora is None)


def strategy_for(
    settings: DataParallelSettings,
    device: torch.device,
    num_params: int,
    ranks_on_host: int,
    host_bytes: int | None = None,
) -> str:
    """The strategy ``ranks_on_host`` ranks take for a model of ``num_params`` on ``device``
    (before the run-time checks; see the module docstring)."""
    mode = settings.cpu_data_parallel
    if device.type != "cpu" or mode == "fsdp":
        return FSDP2
    if settings.mixed_precision_dtype(device) is not None:  # FSDP's policy casts the weights
        return FSDP2
    if ranks_on_host == 1:
        return CPU_REPLICAS  # one process: a plain module, nothing to exchange
    if mode == "auto" or settings.cpu_collectives != "shared_memory":
        return FSDP2  # (both CPU strategies exchange through the shared file)
    if mode == "leader":
        # each sequence-parallel rank computes its own share of the tokens
        return CPU_LEADER if settings.sequence_parallel_size == 1 else FSDP2
    total = host_bytes if host_bytes is not None else node_memory_bytes()
    fits = ranks_on_host * replica_state_bytes(settings, num_params)
    return CPU_REPLICAS if fits <= REPLICA_MEMORY_SHARE * total else FSDP2


def state_bytes_per_rank(
    settings: DataParallelSettings,
    device: torch.device,
    num_params: int,
    ranks: int,
    trainable: bool,
) -> int:
    """One rank's weights, gradients and Adam moments under the strategy the rule gives:
    its shard under FSDP2, the whole state for a replica; under the leader, a host holds one
    state (on its first rank) and a mirror of the weights for the others, counted as equal
    shares."""
    total = training_state_bytes(settings, num_params, trainable)
    name = strategy_for(settings, device, num_params, ranks)
    if name == CPU_REPLICAS:
        return total
    if name == CPU_LEADER:
        total += num_params * settings.torch_param_dtype.itemsize  # the weights' mirror
    return total // ranks
