"""RNG states that a checkpoint can hold without pickled objects.

The driver's trainer state and each engine rank's checkpoint both save and restore the
python, numpy and torch generators; stored as JSON values and tensors they load with
``torch.load(weights_only=True)`` or ``json``, so a checkpoint never has to unpickle code.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(cuda: bool = False) -> dict[str, Any]:
    """This process's python, numpy and torch RNG states as JSON values and tensors (no
    pickled objects): python's is ``(version, 625 ints, gauss)``, numpy's a key array and
    four plain values, torch's a byte tensor; with ``cuda``, every CUDA device's too."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if cuda and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    keys = np.asarray(npy["keys"].numpy(), dtype=np.uint32)
    np.random.set_state(
        (npy["kind"], keys, int(npy["pos"]), int(npy["has_gauss"]), float(npy["cached_gaussian"]))
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
