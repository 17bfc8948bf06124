"""Keeping a rollout engine's process-wide side effects out of the trainer that hosts it.

In hybrid mode a rollout engine (vLLM's ``LLM``, SGLang's ``Engine``) is built inside a
training rank's process, and building it changes state the trainer owns: it reseeds Python's,
NumPy's and torch's RNGs, may change torch's thread count or replace ``torch.set_num_threads``
(vLLM's CPU worker makes it a no-op), and may force multiprocessing's start method (SGLang
sets ``spawn`` for its scheduler processes).  :func:`preserve_process_state` puts all of it
back once the engine exists.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def preserve_process_state() -> Iterator[None]:
    """Restore RNG states, ``torch.set_num_threads`` and the thread count, and the
    multiprocessing start method after the block (engine creation)."""
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    start_method = mp.get_start_method(allow_none=True)
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        if mp.get_start_method(allow_none=True) != start_method:
            mp.set_start_method(start_method, force=True)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads (None: as they are), then restore
    the caller's count: an engine that decodes with a different count than the trainer
    trains with (vLLM's 1 on CPU, the transformers engine's whole host under leader
    generation) changes it for the call only."""
    before = torch.get_num_threads()
    if count is None or count == before:  # setting it anyway is not free
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
