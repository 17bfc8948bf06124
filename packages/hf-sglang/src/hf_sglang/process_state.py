"""Keeping SGLang's process-wide side effects out of the trainer that hosts the engine.

``sglang.Engine(...)`` forces multiprocessing's start method to ``spawn`` (for its scheduler
processes) and may touch RNG and thread settings.  In hybrid mode it lives inside a training
rank's process, so :func:`preserve_process_state` puts all of them back once the engine exists.
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
    """Restore RNG states, torch's thread count and the multiprocessing start method."""
    threads = torch.get_num_threads()
    start_method = mp.get_start_method(allow_none=True)
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if mp.get_start_method(allow_none=True) != start_method:
            mp.set_start_method(start_method, force=True)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
