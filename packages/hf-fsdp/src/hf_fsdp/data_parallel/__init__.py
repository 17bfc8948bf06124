"""How the FSDP engine's ranks share the model: one interface, one module per strategy.

- :mod:`~hf_fsdp.data_parallel.base`: the interface (:class:`DataParallel`) the engine is
  written against;
- :mod:`~hf_fsdp.data_parallel.choice`: which strategy the settings resolve to (the engine's
  and the pre-start memory check's one rule);
- :mod:`~hf_fsdp.data_parallel.build`: the strategy, chosen once when the engine is built;
- :mod:`~hf_fsdp.data_parallel.fsdp2`: FSDP2 shards (GPUs, and CPU ranks by default);
- :mod:`~hf_fsdp.data_parallel.cpu_replicas`: CPU replicas averaging their gradients through
  shared memory (``cpu_data_parallel: replicate``; one CPU process's plain module);
- :mod:`~hf_fsdp.data_parallel.cpu_leader`: the host's first rank trains for every rank
  (``cpu_data_parallel: leader``).

This package's ``__init__`` imports nothing, so ``hf_fsdp.config`` can read the rule without
importing the strategies (which import the config).
"""
