"""Importing SGLang on demand, with the environment its offline engine reads at import time.

SGLang reads some settings from the environment when its modules are first imported:

* ``SGLANG_USE_CPU_ENGINE=1`` selects its CPU platform (it is otherwise CUDA-only); set here
  when the engine is asked to run on the CPU;
* ``SGLANG_RETURN_ORIGINAL_LOGPROB`` would make it return log-probs of the raw logits instead
  of ``softmax(logits / temperature)``; the rollout contract needs the latter, so it is forced
  off.

The scheduler processes SGLang spawns inherit this environment.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

INSTALL_HINT = (
    'install the extra: pip install "hf-sglang[gpu]" (SGLang, CUDA GPUs; SGLang has no CPU '
    "build on PyPI)"
)


class SGLangNotInstalledError(ImportError):
    """The ``sglang`` rollout engine was asked for but SGLang cannot be imported."""


def configure_environment(device: str) -> None:
    """Set the environment SGLang reads at import time (see the module docstring)."""
    if device == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"


def require_sglang(device: str) -> ModuleType:
    """The ``sglang`` module, or an error that says which extra to install."""
    configure_environment(device)
    try:
        return importlib.import_module("sglang")
    except ImportError as exc:
        raise SGLangNotInstalledError(
            f"the 'sglang' rollout engine needs SGLang, which cannot be imported ({exc}); "
            f"{INSTALL_HINT}"
        ) from exc
